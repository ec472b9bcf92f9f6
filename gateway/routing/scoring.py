"""Reusable filters and scorers that the policies are composed of.

Filters narrow the candidates (healthy and not yet tried, under the load bound, meeting the SLA);
scorers turn a candidate into a sort key component (expected prefix hit, load, cost, rendezvous).
A policy is a ranking plus a walk down it that skips what a filter rejects, so `sla` and `cost`
share the prefix scorer and the load guard with `prefix_affinity` instead of re-deriving them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Final, NamedTuple

from .base import UNIT_TOKENS, BackendView, RequestFeatures, Snapshot, stride_for
from .hashing import hrw

DEFAULT_LOAD_FACTOR: Final = 1.25  # Mirrokni et al.'s bounded-load consistent hashing uses c = 1.25
# The additive slack keeps a hot prefix from spilling on the noise of small in-flight counts (which
# also differ between gateway replicas, breaking their agreement); measured by bench/routing.py.
DEFAULT_SLACK: Final = 2.0
# Costs within ~20% of each other are equal, so the prefix hit and load decide: measured throughput
# varies by more than 5% from window to window, and a narrower band made the ranking flap.
COST_TIE: Final = math.log(1.2)


def load_bound(candidates: Sequence[BackendView], *, load_factor: float, slack: float) -> float:
    """The most load a backend may carry and still be chosen: `load_factor` x mean + `slack`.

    Always at least the minimum load (min <= mean), so some candidate is always under the bound.
    """
    return load_factor * sum(v.load_score for v in candidates) / len(candidates) + slack


class LoadBounded:
    """Shared by the policies with a bounded-load guard: its two knobs and the bound they give."""

    def __init__(self, *, load_factor: float = DEFAULT_LOAD_FACTOR, slack: float = DEFAULT_SLACK) -> None:
        if load_factor < 1:
            raise ValueError("load_factor must be at least 1")
        self.load_factor = load_factor
        self.slack = slack

    def bound(self, candidates: Sequence[BackendView]) -> float:
        return load_bound(candidates, load_factor=self.load_factor, slack=self.slack)


def hit_tokens(snapshot: Snapshot, features: RequestFeatures, view: BackendView) -> int:
    """Prompt tokens the approximate prefix index expects `view` to serve from its cache."""
    if not features.chain:
        return 0
    stride = stride_for(view.block_size)
    return snapshot.prefix.match(view.name, features.chain, stride) * stride * UNIT_TOKENS


def hits_for(snapshot: Snapshot, features: RequestFeatures, candidates: Sequence[BackendView]) -> list[int]:
    """The expected cached prompt tokens of every candidate, in one call (this runs on every
    decision): exact where the backend's KV events are live, else the approximate index's."""
    if not features.chain and features.tokens is None:
        return [0] * len(candidates)
    return snapshot.prefix.hits(features, candidates)


def cost_per_output_token(view: BackendView) -> float | None:
    """Live USD per output token: price per hour / tokens per hour; None when either is unknown."""
    tps = view.output_tokens_per_s
    if view.usd_per_hour is None or tps is None or tps <= 0:
        return None
    return view.usd_per_hour / (3600.0 * tps)


def cost_rank(view: BackendView) -> tuple[int, float]:
    """A sort key: known costs first, grouped into ~20% bands so near-ties fall to the next scorer."""
    return _cost_band(view.usd_per_hour, view.output_tokens_per_s)


@lru_cache(maxsize=4096)
def _cost_band(usd_per_hour: float | None, tps: float | None) -> tuple[int, float]:
    # Cached: a fleet has few distinct (price, measured throughput) pairs at a time, and the log is
    # most of the cost policy's per-candidate work.
    if usd_per_hour is None or tps is None or tps <= 0:
        return (1, 0.0)
    cost = usd_per_hour / (3600.0 * tps)
    if cost <= 0:
        return (0, -math.inf)
    return (0, float(round(math.log(cost) / COST_TIE)))


def least_loaded(candidates: Sequence[BackendView], key: int | None) -> BackendView:
    """Lowest load; ties go to the rendezvous winner (or config order without a key)."""
    if key is None:
        return min(candidates, key=lambda v: v.load_score)
    return min(candidates, key=lambda v: (v.load_score, -hrw(key, v.name)))


def by_rendezvous(candidates: Sequence[BackendView], key: int) -> list[BackendView]:
    """Candidates from the highest rendezvous score down: every process ranks alike."""
    return sorted(candidates, key=lambda v: hrw(key, v.name), reverse=True)


def argmin(ranks: Sequence[tuple[float, ...]], key: int | None, name: Callable[[int], str]) -> int:
    """The index of the smallest rank: the one choice rule every policy shares. Ties go to the
    highest rendezvous score of `key` over `name(i)` (computed for the tied only), or to the first
    without a key, so replicas break ties alike."""
    best = min(ranks)
    first = ranks.index(best)
    if key is None or ranks.count(best) == 1:  # the common case, all in C
        return first
    ties = [i for i in range(first, len(ranks)) if ranks[i] == best]
    return max(ties, key=lambda i: hrw(key, name(i)))


def walk(ranked: Sequence[BackendView], admissible: Callable[[BackendView], bool]) -> tuple[BackendView, bool]:
    """The first admissible candidate and whether it was not the first choice (a spill). Falls back
    to the least loaded when nothing is admissible (never the case for the load bound)."""
    for i, view in enumerate(ranked):
        if admissible(view):
            return view, i > 0
    return min(ranked, key=lambda v: v.load_score), True


class Prediction(NamedTuple):
    """One backend's predicted latency for one request (None = not learned yet). A named tuple, not
    a frozen dataclass: one is built per candidate per decision, and frozen init is 5x slower."""

    view: BackendView
    hit_tokens: int
    ttft_s: float | None
    tpot_s: float | None


def predict(snapshot: Snapshot, features: RequestFeatures, view: BackendView, hit: int) -> Prediction:
    """What the latency model predicts for this request on `view`, given its prefix hit."""
    model = snapshot.latency.get(view.name)
    if model is None:
        return Prediction(view, hit, None, None)
    running = view.running if view.running is not None else float(view.in_flight)
    return Prediction(
        view,
        hit,
        model.ttft_s(max(features.prompt_tokens - hit, 0), view.waiting),
        model.tpot_s(running + 1),
    )
