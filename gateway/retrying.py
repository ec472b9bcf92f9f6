"""Background retry loops: one backoff rule, on tenacity, with the injected sleep and random generator.

The loops that wait for something outside the process to come back (discovery sources, the shared
store's reconnect probe, KV-event intake reconnects, worker restarts) all retry the same way:
exponential backoff with jitter, for ever, sleeping through the `sleep` they were given (tests pass
one that does not wait) and drawing jitter from their own `random.Random` (so that replicas which
failed together spread out, and a seeded test is repeatable). tenacity runs the loop (attempts,
outcomes, waits, the log line before each sleep); `Backoff` is its wait strategy.

Not the request path: `proxy/attempts` is one pass over distinct backends with no sleep at all, written
by hand because it runs on every request and must cost nothing when the first attempt succeeds.

Imports nothing of the gateway, so any room may use it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_never
from tenacity.wait import wait_base

Sleep = Callable[[float], Awaitable[None]]


class Backoff(wait_base):
    """`initial_s * multiplier**(failures-1)`, capped at `max_s`, then shortened by up to `jitter` of
    itself. A tenacity wait strategy (the n-th attempt's failure waits `delay(n)`), and usable alone
    by a loop that counts its failures itself."""

    def __init__(self, initial_s: float = 0.5, max_s: float = 30.0, *, multiplier: float = 2.0,
                 jitter: float = 0.2, rng: random.Random | None = None) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.multiplier = multiplier
        self.jitter = jitter
        self.rng = rng if rng is not None else random.Random()

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        exponent = min(max(failures, 1) - 1, 64)
        base = min(self.max_s, self.initial_s * self.multiplier**exponent)
        return float(base * (1.0 - self.jitter * (rng or self.rng).random()))

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.delay(retry_state.attempt_number)

    def __repr__(self) -> str:
        return f"Backoff({self.initial_s:g}..{self.max_s:g} s, x{self.multiplier:g}, jitter {self.jitter:g})"


def forever(
    *, wait: Backoff, sleep: Sleep, retry_on: type[BaseException] | tuple[type[BaseException], ...],
    log: logging.Logger | None = None, what: str = "",
) -> AsyncRetrying:
    """Retry an async operation that raises one of `retry_on` until it succeeds; anything else (a
    cancellation among them) ends the loop at once. With `log`, each failure is logged at WARNING
    before the sleep, as `what` failed (error): retrying in N s.

        async for attempt in forever(wait=Backoff(0.1, 2.0), sleep=self._sleep, retry_on=OSError):
            with attempt:
                await connect()
    """
    before_sleep = None
    if log is not None:
        logger = log

        def before_sleep(state: RetryCallState) -> None:
            outcome = state.outcome
            error = outcome.exception() if outcome is not None else None
            pause = state.next_action.sleep if state.next_action is not None else 0.0
            logger.warning("%s failed (%s: %s): retrying in %.1f s", what or "an operation",
                           type(error).__name__, error, pause)

    return AsyncRetrying(sleep=sleep, wait=wait, stop=stop_never, retry=retry_if_exception_type(retry_on),
                         before_sleep=before_sleep, reraise=True)
