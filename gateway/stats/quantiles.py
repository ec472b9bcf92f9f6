"""Weighted nearest-rank percentiles over bounded sample reservoirs (`observability.reservoir`).

Why reservoirs and not a sketch: tests (and operators) can check a percentile against the exact
samples fed in, as long as a bucket holds fewer samples than its cap. Past the cap, a bucket keeps a
uniform random sample (Li's algorithm L with an injected, seeded RNG: it draws random numbers only for
the samples it keeps, so a full bucket costs a counter increment per observation, which matters on the
per-token path) and remembers how many it saw, so merging buckets of unequal load weights each retained
sample by `seen / kept`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import Protocol

from ..observability.outcome import GapHistogram
from ..observability.reservoir import Reservoir

__all__ = ["Reservoir", "gap_summary", "nearest_rank", "percentile", "summary", "weighted_samples"]


class Sampled(Protocol):
    """A uniform sample of observations: its retained values, how many it saw, what each stands for."""

    @property
    def values(self) -> Sequence[float]: ...

    @property
    def seen(self) -> int: ...

    @property
    def weight(self) -> float: ...


def weighted_samples(reservoirs: Iterable[Sampled]) -> list[tuple[float, float]]:
    """(value, weight) pairs of every retained sample, sorted by value."""
    out: list[tuple[float, float]] = []
    for r in reservoirs:
        w = r.weight
        out.extend((v, w) for v in r.values)
    out.sort()
    return out


def percentile(sorted_pairs: Sequence[tuple[float, float]], q: float) -> float | None:
    """Weighted nearest-rank percentile: the smallest value whose cumulative weight reaches q × total.

    With unit weights this is the textbook nearest-rank definition, `sorted[ceil(q·n) - 1]`.
    """
    if not sorted_pairs:
        return None
    total = math.fsum(w for _, w in sorted_pairs)
    target = q * total * (1 - 1e-12)
    acc = 0.0
    for value, w in sorted_pairs:
        acc += w
        if acc >= target:
            return value
    return sorted_pairs[-1][0]


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """Unweighted nearest-rank percentile of an already sorted, non-empty sequence."""
    k = max(math.ceil(q * len(sorted_values) - 1e-9), 1)
    return sorted_values[k - 1]


def summary(reservoirs: Iterable[Sampled], qs: Sequence[float] = (0.5, 0.95, 0.99)) -> dict[str, float | int | None]:
    """p50/p95/p99 (keys "p50", ...) plus `n`, the number of observations behind them.

    Fast path: while no bucket overflowed its cap every weight is 1 and a plain float sort gives the
    exact nearest-rank values; otherwise one weighted pass serves all the requested percentiles.
    """
    rs = [r for r in reservoirs if r.values]
    keys = [f"p{round(q * 100)}" for q in qs]
    n_seen = sum(r.seen for r in rs)
    out: dict[str, float | int | None] = dict.fromkeys(keys)
    out["n"] = n_seen
    if not rs:
        return out
    values: list[float] = []
    for r in rs:
        values.extend(r.values)
    if n_seen == len(values):
        values.sort()
        for key, q in zip(keys, qs, strict=True):
            out[key] = nearest_rank(values, q)
        return out
    weights: list[float] = []
    for r in rs:
        weights.extend([r.weight] * len(r.values))
    order = sorted(range(len(values)), key=values.__getitem__)
    cumulative = list(accumulate([weights[i] for i in order]))
    total = cumulative[-1]
    for key, q in zip(keys, qs, strict=True):
        k = min(bisect.bisect_left(cumulative, q * total * (1 - 1e-12)), len(order) - 1)
        out[key] = values[order[k]]
    return out


def gap_summary(
    hists: Iterable[GapHistogram], qs: Sequence[float] = (0.5, 0.95, 0.99)
) -> dict[str, float | int | None]:
    """Nearest-rank p50/p95/p99 (and `n`) of the gaps in `hists`: the cell where the rank falls, read as
    its one value when it saw only one, else its middle clamped to what it saw (within 1%)."""
    merged = GapHistogram()
    for h in hists:
        merged.merge(h)
    n = merged.count
    out: dict[str, float | int | None] = {f"p{round(q * 100)}": None for q in qs}
    out["n"] = n
    if not n:
        return out
    order = sorted(merged.cells.items())
    for q in qs:
        rank = max(math.ceil(q * n - 1e-9), 1)
        acc = 0
        for _, cell in order:
            acc += cell.count
            if acc >= rank:
                out[f"p{round(q * 100)}"] = cell.value
                break
    return out
