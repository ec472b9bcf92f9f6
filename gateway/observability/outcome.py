"""What one finished request was, as the proxy saw it: the one record that metrics, the live
statistics and per-key accounting are all fed from (`proxy.accounting` builds it, once per request)."""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Iterable

from backends.base import Usage
from backends.values import value

from .reservoir import Reservoir

NONE = "none"  # the label of what is not known (unroutable requests: no backend, runtime or route)

# Inter-token latency histogram bounds, shared by the Prometheus family and each stream's own counts.
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)
GAP_SAMPLE = 16  # inter-token gaps each stream keeps for the live percentiles (a uniform sample)


class Gaps:
    """One stream's inter-token gaps in O(1) memory, however long the stream: their count and sum,
    their counts per `ITL_BUCKETS` bucket (merged exactly into the Prometheus histogram) and a
    uniform sample of `GAP_SAMPLE` (merged into the statistics windows, weighted by what it stands
    for)."""

    __slots__ = ("buckets", "count", "rng", "sample", "sum")

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.count = 0
        self.sum = 0.0
        self.buckets = [0] * (len(ITL_BUCKETS) + 1)  # the last: above every bound
        self.sample = Reservoir(GAP_SAMPLE)

    def add(self, gap_s: float, times: int = 1) -> None:
        """`times` gaps of `gap_s` each (tokens that arrived together share the interval before them)."""
        self.count += times
        self.sum += gap_s * times
        self.buckets[bisect_left(ITL_BUCKETS, gap_s)] += times
        self.sample.add_many(gap_s, times, self.rng)

    @property
    def mean_s(self) -> float | None:
        return self.sum / self.count if self.count else None

    @classmethod
    def of(cls, gaps_s: Iterable[float], rng: random.Random | None = None) -> Gaps:
        gaps = cls(rng if rng is not None else random.Random(0))
        for gap in gaps_s:
            gaps.add(gap)
        return gaps


@value
class Outcome:
    """One finished request. Every generation request produces exactly one, whatever ended it."""

    backend: str
    runtime: str
    model: str
    status: str  # HTTP status as a string, or "stream_error" / "client_closed"
    duration_s: float
    usage: Usage | None = None
    ttft_s: float | None = None
    gaps: Gaps | None = None
    reason: str = NONE  # the routing decision's low-cardinality reason
    arm: str | None = None  # the A/B arm, when the route is split
    sla: str | None = None  # "met" / "missed" when the request carried an SLA target
    finished_at: float = 0.0  # clock reading at the end (for windowed statistics)
    # the prompt tokens are the gateway's estimate: the response carried no usage (the client left,
    # or the stream broke, before the engine reported it)
    usage_estimated: bool = False
    # seconds from the first to the last generated token (the span output tokens are attributed to)
    generation_s: float | None = None
    endpoint: str = "chat"  # `backends.base.Endpoint`: chat, completions, responses, embeddings, tokenize, ...
