"""Fault knobs: the failures a gateway must survive, injected on purpose.

`FaultGate` holds the only mutable fault state (how many requests were failed so far, the seeded RNG)
and reads wall time only through the clock it is given.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Faults:
    fail_first: int = 0  # fail the first N generation requests with `fail_status`
    fail_status: int = 503
    fail_rate: float = 0.0  # then fail this fraction of requests (seeded RNG)
    hang: bool = False  # accept requests but never produce a first token
    die_after_tokens: int | None = None  # close the connection abruptly after K streamed tokens
    error_after_tokens: int | None = None  # send the runtime's mid-stream error event after K tokens
    not_ready_for_s: float = 0.0  # wall seconds after start during which health fails and requests get 503
    max_queue: int | None = None  # refuse new requests (503) while this many are waiting

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError("fail_rate must be within [0, 1]")
        if self.fail_first < 0 or (self.die_after_tokens is not None and self.die_after_tokens < 0):
            raise ValueError("fault counts must not be negative")


class FaultGate:
    def __init__(self, faults: Faults, *, seed: int, clock: Callable[[], float]) -> None:
        self.faults = faults
        self._rng = random.Random(seed)
        self._clock = clock
        self._started = clock()
        self._seen = 0

    def ready(self) -> bool:
        return self._clock() - self._started >= self.faults.not_ready_for_s

    def injected_failure(self) -> int | None:
        """Call once per generation request: the status to fail it with, or None to serve it."""
        self._seen += 1
        f = self.faults
        if self._seen <= f.fail_first:
            return f.fail_status
        if f.fail_rate > 0 and self._rng.random() < f.fail_rate:
            return f.fail_status
        return None

    def queue_full(self, waiting: int) -> bool:
        return self.faults.max_queue is not None and waiting >= self.faults.max_queue
