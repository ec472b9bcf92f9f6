"""What one finished request was, as the proxy saw it: the one record that metrics, the live
statistics and per-key accounting are all fed from (`proxy.accounting` builds it, once per request)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from backends.base import Usage

NONE: Final = "none"  # the label of what is not known (unroutable requests: no backend, runtime or route)

# Inter-token latency histogram bounds, shared by the Prometheus family and each stream's own counts.
ITL_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
# The live percentiles' resolution: log-spaced cells 2% wide, so a percentile read from the cells is
# within 1% of the exact one (and exact while a cell holds one distinct value).
CELL_BASE: Final = 1.02
_LOG_BASE: Final = math.log(CELL_BASE)
_ZERO_CELL: Final = -(1 << 30)  # the cell of gaps of 0 s (tokens that arrived in one read)
_SLOTS: Final = 16  # the recently used cells a histogram finds without a dict lookup (a power of two)


class Cell:
    """One log-spaced cell of a GapHistogram (number `i`): how many gaps, the smallest and the largest."""

    __slots__ = ("count", "hi", "i", "lo")

    def __init__(self, i: int, count: int, lo: float, hi: float) -> None:
        self.i = i
        self.count = count
        self.lo = lo
        self.hi = hi

    @property
    def value(self) -> float:
        """What the cell's gaps are read as: its one value, or its middle clamped to what it saw."""
        if self.lo == self.hi:
            return self.lo
        return min(max(math.sqrt(self.lo * self.hi), self.lo), self.hi)


class GapHistogram:
    """Inter-token gaps as counts in log-spaced cells: O(distinct cells) memory, exact counts, merged
    by adding counts. Each cell also keeps the smallest and largest gap it saw, so a cell that only
    ever saw one value reports it exactly. The per-token cost is a log and a list lookup: a stream's
    gaps jitter over a few neighbouring cells, so the cells used last are kept in `_SLOTS` slots by
    cell number (direct-mapped), and the dict is consulted only when a gap falls in a cell that is
    not in its slot. (`cells` may be replaced only on a new histogram: the slots refer to its cells.)"""

    __slots__ = ("_recent", "cells", "count")

    def __init__(self) -> None:
        self.cells: dict[int, Cell] = {}
        self.count = 0
        self._recent: list[Cell | None] = [None] * _SLOTS

    def add(self, gap_s: float, times: int = 1) -> None:
        self.count += times
        i = math.floor(math.log(gap_s) / _LOG_BASE) if gap_s > 0 else _ZERO_CELL
        slot = i & (_SLOTS - 1)
        recent = self._recent
        cell = recent[slot]
        if cell is None or cell.i != i:
            cell = self.cells.get(i)
            if cell is None:
                self.cells[i] = recent[slot] = Cell(i, times, gap_s, gap_s)
                return
            recent[slot] = cell
        cell.count += times
        if gap_s < cell.lo:
            cell.lo = gap_s
        elif gap_s > cell.hi:
            cell.hi = gap_s

    def merge(self, other: GapHistogram) -> None:
        self.count += other.count
        cells = self.cells
        for i, c in other.cells.items():
            cell = cells.get(i)
            if cell is None:
                cells[i] = Cell(i, c.count, c.lo, c.hi)
            else:
                cell.count += c.count
                if c.lo < cell.lo:
                    cell.lo = c.lo
                if c.hi > cell.hi:
                    cell.hi = c.hi


class Gaps:
    """One stream's inter-token gaps in O(1) memory, however long the stream: their count, sum and a
    `GapHistogram`, from which the Prometheus histogram and the statistics windows are fed at the end
    (a cell that straddles a Prometheus bound counts on the side of its value: within the cells' 2%)."""

    __slots__ = ("count", "hist", "sum")

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0.0
        self.hist = GapHistogram()

    def add(self, gap_s: float, times: int = 1) -> None:
        """`times` gaps of `gap_s` each (tokens that arrived together share the interval before them)."""
        self.count += times
        self.sum += gap_s * times
        self.hist.add(gap_s, times)

    @property
    def mean_s(self) -> float | None:
        return self.sum / self.count if self.count else None

    @classmethod
    def of(cls, gaps_s: Iterable[float]) -> Gaps:
        gaps = cls()
        for gap in gaps_s:
            gaps.add(gap)
        return gaps


@dataclass(slots=True, unsafe_hash=True)
class Outcome:
    """One finished request. Every generation request produces exactly one, whatever ended it."""

    backend: Final[str]
    runtime: Final[str]
    model: Final[str]
    status: Final[str]  # HTTP status as a string, or "stream_error" / "client_closed"
    duration_s: Final[float]
    usage: Final[Usage | None]
    ttft_s: Final[float | None]
    gaps: Final[Gaps | None]
    reason: Final[str]  # the routing decision's low-cardinality reason
    arm: Final[str | None]  # the A/B arm, when the route is split
    sla: Final[str | None]  # "met" / "missed" when the request carried an SLA target
    finished_at: Final[float]  # clock reading at the end (for windowed statistics)
    # the prompt tokens are the gateway's estimate: the response carried no usage (the client left,
    # or the stream broke, before the engine reported it)
    usage_estimated: Final[bool]
    # seconds from the first to the last generated token (the span output tokens are attributed to)
    generation_s: Final[float | None]
    # the cached tokens routing expected on the backend (`x-gateway-expected-cached-tokens`) and
    # which prefix index said so ("exact": the engine's KV events, "approximate": what was sent)
    expected_cached_tokens: Final[int | None]
    prediction: Final[str | None]
    endpoint: Final[str]  # `backends.base.Endpoint`: chat, completions, responses, embeddings, tokenize, ...
    rank: Final[int | None]  # the backend's data-parallel rank it was pinned to (None: not pinned)
    request_id: Final[str]  # (the access log's, never a metrics label)
    trace_id: Final[str | None]  # the request's trace when tracing is on (`gateway.tracing`)
    sampled: Final[bool]  # ... and whether its spans were recorded (metrics exemplars point only at those)
    # prefill/decode disaggregation (`observability.pd`): "split" or "whole" on a disaggregated route
    # (None elsewhere); a split request's prefill backend (None: no prefill answered), leg 1's time,
    # and the transfer time (prefill end to the decode's first token, streams)
    topology: Final[str | None]
    prefill: Final[str | None]
    prefill_s: Final[float | None]
    transfer_s: Final[float | None]

    def __init__(
        self, backend: str, runtime: str, model: str, status: str, duration_s: float,
        usage: Usage | None = None, ttft_s: float | None = None, gaps: Gaps | None = None, reason: str = NONE,
        arm: str | None = None, sla: str | None = None, finished_at: float = 0.0, usage_estimated: bool = False,
        generation_s: float | None = None, expected_cached_tokens: int | None = None, prediction: str | None = None,
        endpoint: str = "chat", rank: int | None = None, request_id: str = "", trace_id: str | None = None,
        sampled: bool = False, topology: str | None = None, prefill: str | None = None,
        prefill_s: float | None = None, transfer_s: float | None = None,
    ) -> None:
        self.backend = backend
        self.runtime = runtime
        self.model = model
        self.status = status
        self.duration_s = duration_s
        self.usage = usage
        self.ttft_s = ttft_s
        self.gaps = gaps
        self.reason = reason
        self.arm = arm
        self.sla = sla
        self.finished_at = finished_at
        self.usage_estimated = usage_estimated
        self.generation_s = generation_s
        self.expected_cached_tokens = expected_cached_tokens
        self.prediction = prediction
        self.endpoint = endpoint
        self.rank = rank
        self.request_id = request_id
        self.trace_id = trace_id
        self.sampled = sampled
        self.topology = topology
        self.prefill = prefill
        self.prefill_s = prefill_s
        self.transfer_s = transfer_s
