"""The arithmetic of `bench scale`, apart from the processes it runs (tests/bench/test_scale_stats.py).

- How many streams one process can hold: two sockets each (client and upstream) under its open-file
  limit, beside the descriptors it has already.
- Memory per stream: the least-squares slope of RSS against the number of open streams over several
  levels (fixed costs such as allocator arenas cancel out), beside the plain (plateau - before) / N.
- When RSS has settled (`settled`): the last samples within a tolerance of each other.
- Event-loop lag quantiles from the deltas of a Prometheus histogram's cumulative buckets between two
  scrapes, interpolated within a bucket as PromQL's `histogram_quantile` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import median

from prometheus_client.parser import text_string_to_metric_families

SOCKETS_PER_STREAM = 2
FD_MARGIN = 32  # descriptors a process opens later (health probes, a scrape, a log file)


def max_streams(nofile: int, fds_in_use: int, *, margin: int = FD_MARGIN) -> int:
    """The most streams a proxy with `fds_in_use` descriptors open can hold under `nofile`."""
    return max((nofile - fds_in_use - margin) // SOCKETS_PER_STREAM, 0)


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of y against x (None with fewer than two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def kib_per_stream(levels: Sequence[tuple[int, int]], before: int) -> dict[str, float | None]:
    """From (streams open, RSS bytes at its plateau) per level and the RSS before any stream: the
    slope over the levels and the origin (0, before), and the largest level's plain average."""
    if not levels:
        return {"slope_kib": None, "average_kib": None}
    n, rss = max(levels)
    fit = slope([(0.0, float(before)), *((float(k), float(r)) for k, r in levels)])
    return {"slope_kib": fit / 1024 if fit is not None else None,
            "average_kib": (rss - before) / 1024 / n if n else None}


def settled(samples: Sequence[float], *, last: int = 4, tolerance: float = 0.01) -> bool:
    """The last `last` samples lie within `tolerance` (a fraction) of their largest."""
    if len(samples) < last:
        return False
    tail = samples[-last:]
    top = max(tail)
    return top <= 0 or (top - min(tail)) / top <= tolerance


Buckets = dict[float, float]  # upper bound (le) -> cumulative count; +Inf as math.inf


def histogram(text: str, name: str) -> Buckets:
    """The cumulative buckets of histogram `name` in a Prometheus text page (summed over label sets)."""
    out: Buckets = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_bucket":
                le = float(sample.labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
    return out


def delta(before: Mapping[float, float], after: Mapping[float, float]) -> Buckets:
    return {le: after[le] - before.get(le, 0.0) for le in after}


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """`histogram_quantile(q, ...)` over cumulative buckets: linear within the bucket the rank falls
    in; the largest finite bound when it falls in +Inf; None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def share_at_most(bound: float, buckets: Mapping[float, float]) -> float | None:
    """The share of observations at most `bound` (which must be a bucket bound)."""
    total = buckets.get(math.inf) or (buckets[max(buckets)] if buckets else 0.0)
    if not total:
        return None
    return buckets.get(bound, 0.0) / total


def ratio_of_medians(base: Sequence[float], other: Sequence[float]) -> float | None:
    """median(other) / median(base): the workers section's scaling."""
    if not base or not other or median(base) == 0:
        return None
    return median(other) / median(base)


def others_cpu(busy_s: float, ours_s: float, wall_s: float) -> float:
    """Cores the rest of the machine used over `wall_s`: its busy time less our processes'."""
    return max(busy_s - ours_s, 0.0) / wall_s if wall_s > 0 else 0.0
