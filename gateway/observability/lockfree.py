"""Lock-free Prometheus counters and histograms for the per-request and per-token paths.

prometheus_client's Histogram takes a mutex per observation (about 1.5 µs here), which is most of
what a relayed token costs when every inter-token gap is observed. The gateway records from one
asyncio thread per process and Prometheus scrapes on that same thread, so plain integer lists are
enough: an observation is a search of the bounds and one list increment, a count one float addition.
The exposition is a normal histogram or counter family, indistinguishable to scrapers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final, Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, Exemplar, HistogramMetricFamily

C = TypeVar("C")
EXEMPLAR_LABEL: Final = "trace_id"  # what Grafana and Prometheus look for to link a bucket to its trace


def bucket_of(bounds: tuple[float, ...], value: float) -> int:
    """`bisect.bisect_left(bounds, value)`: the first bound not below `value`. A linear search,
    compiled: latencies fall in the first few of a histogram's ~20 bounds, and this costs ~15
    instructions a bound where a call of `bisect_left` costs ~750 (its call and argument parsing from
    compiled code, and a rich comparison of boxed floats at each step)."""
    i = 0
    for bound in bounds:
        if value <= bound:
            return i
        i += 1
    return i


class HistogramChild:
    __slots__ = ("bounds", "counts", "exemplars", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: above every finite bound (+Inf)
        self.sum = 0.0
        # per bucket, the latest observation that came with a trace: (trace id, value, Unix time)
        self.exemplars: list[tuple[str, float, float] | None] | None = None

    def observe(self, value: float) -> None:
        self.counts[bucket_of(self.bounds, value)] += 1
        self.sum += value

    def observe_exemplar(self, value: float, trace_id: str, at: float) -> None:
        """`observe(value)`, kept as its bucket's exemplar (OpenMetrics: a link from the bucket to
        the trace of a request in it)."""
        i = bucket_of(self.bounds, value)
        self.counts[i] += 1
        self.sum += value
        exemplars = self.exemplars
        if exemplars is None:
            exemplars = self.exemplars = [None] * len(self.counts)
        exemplars[i] = (trace_id, value, at)

    def observe_many(self, values: Iterable[float]) -> None:
        bounds, counts = self.bounds, self.counts
        total = 0.0
        for v in values:
            counts[bucket_of(bounds, v)] += 1
            total += v
        self.sum += total

    def observe_counted(self, values: Iterable[tuple[float, int]], total: float) -> None:
        """Add `n` observations of each `(value, n)`, whose sum is `total`."""
        bounds, counts = self.bounds, self.counts
        for v, n in values:
            counts[bucket_of(bounds, v)] += n
        self.sum += total


class _Family(Generic[C]):
    """A metric family to register with a CollectorRegistry; `labels(*values)` returns a cached child."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], C] = {}

    def _child(self) -> C:
        raise NotImplementedError

    def children(self) -> dict[tuple[str, ...], C]:
        """Every labelled child created so far, by label values (do not modify)."""
        return self._children

    def labels(self, *values: str) -> C:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self._children[values] = self._child()
        return child


class FastHistogram(_Family[HistogramChild]):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, labelnames)
        self.bounds = tuple(float(b) for b in buckets if not math.isinf(b))

    def _child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            cumulative: list[Any] = []
            acc = 0
            exemplars = child.exemplars
            for i, (bound, count) in enumerate(zip((*self.bounds, math.inf), child.counts, strict=True)):
                acc += count
                name = "+Inf" if math.isinf(bound) else repr(bound)
                kept = exemplars[i] if exemplars is not None else None
                if kept is None:
                    cumulative.append((name, float(acc)))
                else:
                    cumulative.append((name, float(acc), Exemplar({EXEMPLAR_LABEL: kept[0]}, kept[1], kept[2])))
            family.add_metric(list(values), cumulative, child.sum)
        yield family



class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class FastCounter(_Family[CounterChild]):
    """Exposed as `<name>_total`."""

    def _child(self) -> CounterChild:
        return CounterChild()

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            family.add_metric(list(values), child.value)
        yield family
