"""Sliding windows as time buckets: bounded memory, exact counts, time only from the caller.

Each group (a backend, a runtime, an A/B arm, the whole gateway) keeps two rings of buckets:
1-second buckets for the last 300 s and 1-minute buckets for the last hour. A window of W seconds is
the last W *completed* seconds (the current, partial second is left out so a rate's denominator is
exact): W <= 300 reads 1-s buckets; longer windows read completed minutes plus the 1-s buckets of the
current minute. Before the group has existed for W seconds, the span is the time since it started.

Memory per group is fixed by the ring sizes and the per-bucket sample caps (`Caps`), whatever the load.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from backends.values import value

from ..observability.outcome import Gaps
from .quantiles import Reservoir

FINE_S = 1
FINE_BUCKETS = 300
COARSE_S = 60
COARSE_BUCKETS = 60
PEAK_SPAN_S = 10  # "best throughput seen": the best output tokens/s over any 10 completed seconds


@dataclass(frozen=True, slots=True)
class Caps:
    """Samples kept per bucket (beyond that, a uniform reservoir sample)."""

    ttft: int
    itl: int
    tpot: int
    e2e: int


FINE_CAPS = Caps(ttft=32, itl=64, tpot=32, e2e=32)
COARSE_CAPS = Caps(ttft=128, itl=512, tpot=128, e2e=128)


class Bucket:
    """Everything that finished in one time slot."""

    __slots__ = (
        "cached_tokens", "completion_tokens", "e2e", "errors", "index", "itl", "prompt_tokens", "requests",
        "sla_met", "sla_missed", "tpot", "ttft",
    )

    def __init__(self, index: int, caps: Caps) -> None:
        self.index = index
        self.requests = 0
        self.errors = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.sla_met = 0
        self.sla_missed = 0
        self.ttft = Reservoir(caps.ttft)
        self.itl = Reservoir(caps.itl)
        self.tpot = Reservoir(caps.tpot)
        self.e2e = Reservoir(caps.e2e)


class Ring:
    """`size` buckets of `resolution_s` seconds, reused in place as time moves on."""

    def __init__(self, resolution_s: int, size: int, caps: Caps) -> None:
        self.resolution_s = resolution_s
        self.size = size
        self.caps = caps
        self._slots: list[Bucket | None] = [None] * size

    def at(self, index: int) -> Bucket:
        slot = index % self.size
        b = self._slots[slot]
        if b is None or b.index != index:
            b = self._slots[slot] = Bucket(index, self.caps)
        return b

    def get(self, index: int) -> Bucket | None:
        b = self._slots[index % self.size]
        return b if b is not None and b.index == index else None

    def range(self, start: int, stop: int) -> Iterator[Bucket]:
        """Buckets with start <= index < stop that hold data (stale slots are skipped)."""
        for i in range(max(start, stop - self.size), stop):
            b = self.get(i)
            if b is not None:
                yield b


@value
class Sample:
    """One finished request, reduced to what the windows keep."""

    at: float
    error: bool
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    gaps: Gaps | None  # inter-token gaps (a stream's count, sum and sample)
    tpot_s: float | None
    e2e_s: float
    sla: str | None


@dataclass(frozen=True, slots=True)
class View:
    """The buckets a window covers and the exact number of seconds they span (0 = nothing yet)."""

    buckets: tuple[Bucket, ...]
    span_s: int
    fine: tuple[Bucket, ...]  # the 1-s buckets only, for per-second series (empty for long windows)


class Series:
    """One group's windows, plus the best throughput it has shown so far."""

    def __init__(self, started_at: float, rng: random.Random) -> None:
        self.start_s = math.floor(started_at)
        self._rng = rng
        self.fine = Ring(FINE_S, FINE_BUCKETS, FINE_CAPS)
        self.coarse = Ring(COARSE_S, COARSE_BUCKETS, COARSE_CAPS)
        self.peak_output_tps = 0.0
        self._peak_checked = self.start_s + PEAK_SPAN_S - 2  # last second whose 10-s span was scored
        self._second: int | None = None  # the second of the last add, and its two buckets
        self._buckets: tuple[Bucket, Bucket] | None = None

    def add(self, s: Sample) -> None:
        second = math.floor(s.at)
        buckets = self._buckets
        if second != self._second or buckets is None:  # once a second: score spans, find the buckets
            self.advance(s.at)
            buckets = self._buckets = (self.fine.at(second), self.coarse.at(second // COARSE_S))
            self._second = second
        for b in buckets:
            b.requests += 1
            b.errors += s.error
            b.prompt_tokens += s.prompt_tokens
            b.completion_tokens += s.completion_tokens
            b.cached_tokens += s.cached_tokens
            if s.sla == "met":
                b.sla_met += 1
            elif s.sla == "missed":
                b.sla_missed += 1
            if s.ttft_s is not None:
                b.ttft.add(s.ttft_s, self._rng)
            if s.tpot_s is not None:
                b.tpot.add(s.tpot_s, self._rng)
            b.e2e.add(s.e2e_s, self._rng)
            if s.gaps is not None:
                b.itl.absorb(s.gaps.sample, self._rng)

    def advance(self, now: float) -> None:
        """Score every newly completed 10-s span for the best-throughput figure."""
        last_complete = math.floor(now) - 1
        first = max(self._peak_checked + 1, last_complete - FINE_BUCKETS + PEAK_SPAN_S)
        for end in range(first, last_complete + 1):
            tokens = sum(b.completion_tokens for b in self.fine.range(end - PEAK_SPAN_S + 1, end + 1))
            self.peak_output_tps = max(self.peak_output_tps, tokens / PEAK_SPAN_S)
        self._peak_checked = max(self._peak_checked, last_complete)

    def view(self, now: float, window_s: int) -> View:
        cur = math.floor(now)
        if window_s <= FINE_BUCKETS:
            start = cur - window_s
            fine = tuple(self.fine.range(start, cur))
            return View(fine, max(cur - max(start, self.start_s), 0), fine)
        minute = cur // COARSE_S
        first_minute = -(-(cur - window_s) // COARSE_S)
        minutes = tuple(self.coarse.range(first_minute, minute))
        tail = tuple(self.fine.range(minute * COARSE_S, cur))
        start = first_minute * COARSE_S
        return View(minutes + tail, max(cur - max(start, self.start_s), 0), ())
