"""Sliding windows as time buckets: bounded memory, exact counts, time only from the caller.

Each group (a backend, a runtime, an A/B arm, the whole gateway) keeps two rings of buckets:
1-second buckets for the last 300 s and 1-minute buckets for the last hour. A window of W seconds is
the last W *completed* seconds (the current, partial second is left out so a rate's denominator is
exact): W <= 300 reads 1-s buckets; longer windows read completed minutes plus the 1-s buckets of the
current minute. Before the group has existed for W seconds, the span is the time since it started.

Two kinds of figure live in a bucket:
- by finish time (exact integers): requests, errors, prompt/completion/cached tokens and the latency
  samples of the requests that *finished* in the slot;
- by generation time (`output_tokens`, a float): each finished request's completion tokens spread
  evenly over its generation lifetime (`generation_s`, first to last token, ending when it finished)
  in proportion to how much of each slot it overlaps. Throughput (output tokens/s, the A/B
  throughput series, the best-throughput figure) reads these, so 60 streams of 60 s that finish in
  the same second count as the 60 s of work they were, not as one second of 60x the rate. Tokens
  reach the buckets when their request finishes: a window's output tokens/s leaves out streams still
  running, and tokens older than a ring holds (or than the group) are dropped from that ring.

Memory per group is fixed by the ring sizes and the per-bucket sample caps (`Caps`), whatever the load.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from ..observability.outcome import GapHistogram, Gaps
from .peak import Peak
from .quantiles import Reservoir

FINE_S: Final = 1
FINE_BUCKETS: Final = 300
COARSE_S: Final = 60
COARSE_BUCKETS: Final = 60


@dataclass(frozen=True, slots=True)
class Caps:
    """Samples kept per bucket (beyond that, a uniform reservoir sample)."""

    ttft: int
    tpot: int
    e2e: int


FINE_CAPS: Final = Caps(ttft=32, tpot=32, e2e=32)
COARSE_CAPS: Final = Caps(ttft=128, tpot=128, e2e=128)


class Bucket:
    """Everything that finished in one time slot, and the output tokens generated during it."""

    __slots__ = (
        "cached_tokens", "completion_tokens", "e2e", "errors", "index", "itl", "output_tokens", "prompt_tokens",
        "requests", "sla_met", "sla_missed", "tpot", "ttft",
    )

    def __init__(self, index: int, caps: Caps) -> None:
        self.index = index
        self.requests = 0
        self.errors = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0  # of the requests that finished in this slot
        self.output_tokens = 0.0  # completion tokens attributed to this slot by generation time
        self.cached_tokens = 0
        self.sla_met = 0
        self.sla_missed = 0
        self.ttft = Reservoir(caps.ttft)
        self.itl = GapHistogram()  # inter-token gaps: counts in log cells (exact counts, bounded memory)
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


@dataclass(slots=True, unsafe_hash=True)
class Sample:
    """One finished request, reduced to what the windows keep."""

    at: Final[float]
    error: Final[bool]
    prompt_tokens: Final[int]
    completion_tokens: Final[int]
    cached_tokens: Final[int]
    ttft_s: Final[float | None]
    gaps: Final[Gaps | None]  # inter-token gaps (a stream's count, sum and sample)
    tpot_s: Final[float | None]
    e2e_s: Final[float]
    sla: Final[str | None]
    generation_s: Final[float | None]  # first to last token; None or 0: all tokens at `at`

    def __init__(
        self, at: float, error: bool, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
        ttft_s: float | None, gaps: Gaps | None, tpot_s: float | None, e2e_s: float, sla: str | None,
        generation_s: float | None = None,
    ) -> None:
        self.at = at
        self.error = error
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.cached_tokens = cached_tokens
        self.ttft_s = ttft_s
        self.gaps = gaps
        self.tpot_s = tpot_s
        self.e2e_s = e2e_s
        self.sla = sla
        self.generation_s = generation_s


@dataclass(frozen=True, slots=True)
class View:
    """The buckets a window covers and the exact number of seconds they span (0 = nothing yet)."""

    buckets: tuple[Bucket, ...]
    span_s: int
    fine: tuple[Bucket, ...]  # the 1-s buckets only, for per-second series (empty for long windows)


def spread(ring: Ring, tokens: float, start: float, end: float, oldest: int) -> None:
    """Add `tokens` to `ring`'s buckets in proportion to how much of [start, end] each covers; the
    part before bucket `oldest` is dropped. An empty interval puts everything in `end`'s bucket."""
    res = ring.resolution_s
    last = math.floor(end / res)
    if last < oldest:
        return
    first = math.floor(start / res)
    if first >= last or end <= start:  # within one bucket (the common, short request)
        ring.at(last).output_tokens += tokens
        return
    per_s = tokens / (end - start)
    if first >= oldest:
        ring.at(first).output_tokens += per_s * ((first + 1) * res - start)
    full = per_s * res
    for i in range(max(first + 1, oldest), last):
        ring.at(i).output_tokens += full
    if end > last * res:
        ring.at(last).output_tokens += per_s * (end - last * res)


class Series:
    """One group's windows, plus its best throughput (`peak.Peak`, read as `peak_output_tps`)."""

    def __init__(self, started_at: float, rng: random.Random) -> None:
        self.start_s = math.floor(started_at)
        self._rng = rng
        self.fine = Ring(FINE_S, FINE_BUCKETS, FINE_CAPS)
        self.coarse = Ring(COARSE_S, COARSE_BUCKETS, COARSE_CAPS)
        self.peak = Peak(self.start_s)
        self._latest = self.start_s  # the newest second written: older slots may hold no newer data
        self._second: int | None = None  # the second of the last add, and its two buckets
        self._buckets: tuple[Bucket, Bucket] | None = None

    @property
    def peak_output_tps(self) -> float | None:
        """The best output tokens/s this group shows (a decaying p90 of 10-s spans; None = unknown)."""
        return self.peak.value

    def add(self, s: Sample) -> None:
        second = math.floor(s.at)
        buckets = self._buckets
        if second != self._second or buckets is None:  # once a second: score spans, find the buckets
            self.advance(s.at)
            buckets = self._buckets = (self.fine.at(second), self.coarse.at(second // COARSE_S))
            self._second = second
            self._latest = max(self._latest, second)
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
                b.itl.merge(s.gaps.hist)
        tokens = s.completion_tokens
        if tokens:
            start = s.at - s.generation_s if s.generation_s else s.at
            if start >= second:  # generated within the second it finished in (the common, short request)
                buckets[0].output_tokens += tokens
                buckets[1].output_tokens += tokens
            else:
                oldest = max(self._latest - FINE_BUCKETS + 1, self.start_s)  # never overwrite a newer slot
                spread(self.fine, tokens, start, s.at, oldest)
                spread(self.coarse, tokens, start, s.at,
                       max(self._latest // COARSE_S - COARSE_BUCKETS + 1, self.start_s // COARSE_S))

    def output_tokens(self, start: int, stop: int) -> float:
        """Output tokens attributed to the seconds start <= s < stop (the 1-s ring only)."""
        return math.fsum(b.output_tokens for b in self.fine.range(start, stop))

    def advance(self, now: float) -> None:
        """Score the spans that are now old enough for the best-throughput figure (see `peak`)."""
        self.peak.advance(math.floor(now), self.output_tokens)

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
