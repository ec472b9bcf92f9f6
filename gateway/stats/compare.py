"""The comparison document served at `GET /admin/compare` and printed by `gateway compare`.

Built from the stats book at a given `now`; A/B analyses are the expensive part (bootstrap), so they
are cached per (window, whole 5-second step of the clock): polling every 2 s costs one analysis per
5 s at most, and a given `now` always gives the same answer. `document_async` copies the arms' samples
on the event loop and runs the (pure) analysis in a worker thread, so relaying never waits on it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

from ..rank_settings import unit_backend
from .ab import ArmData, analyse
from .book import Group
from .cost import ASSUMPTIONS, group_price
from .figures import figures
from .history import history
from .quantiles import summary
from .views import BookView
from .window import FINE_BUCKETS

WINDOWS_S = (60, 300, 3600)
AB_CACHE_S = 5


def leg_figures(g: Group | None, now: float, window_s: int) -> dict[str, Any]:
    """A pair's leg times: `prefill_s` (leg 1, sent to answered) and `transfer_s` (its end to the
    decode's first token, streams), from its `pair_legs` group (`book.leg_sample`)."""
    if g is None:
        return {"prefill_s": summary(()), "transfer_s": summary(())}
    g.series.advance(now)
    bs = g.series.view(now, window_s).buckets
    return {"prefill_s": summary(b.e2e for b in bs), "transfer_s": summary(b.ttft for b in bs)}


class Comparer:
    def __init__(self, book: BookView, *, min_n: int = 100, seed: int = 0) -> None:
        self.book = book
        self.min_n = min_n
        self.seed = seed
        self._ab_cache: dict[tuple[int, int], list[dict[str, Any]]] = {}
        self._doc_cache: dict[tuple[int, int], dict[str, Any]] = {}

    def document(self, now: float, window_s: int) -> dict[str, Any]:
        """The comparison at `now`. Only completed seconds count, so everything but `now_s` and
        `uptime_s` is the same within one clock second: it is computed once per second and window."""
        key = (window_s, math.floor(now))
        base = self._doc_cache.get(key)
        if base is None:
            base = self._document(now, window_s)
            self._doc_cache = {k: v for k, v in self._doc_cache.items() if k[1] == key[1]}
            self._doc_cache[key] = base
        return {**base, "now_s": now, "uptime_s": now - self.book.started_at}

    def _document(self, now: float, window_s: int) -> dict[str, Any]:
        book = self.book

        def row(g: Group, **extra: Any) -> dict[str, Any]:
            return {"name": g.name, **extra, "backends": list(g.backends), **figures(book, g, now, window_s)}

        return {
            "window_s": window_s,
            "now_s": now,
            "uptime_s": now - book.started_at,
            "assumptions": list(ASSUMPTIONS),
            "percentiles": "nearest-rank over retained samples (weighted by bucket when a bucket was sampled)",
            "total": row(book.total),
            "backends": [row(g, runtime=g.runtime, task=g.task) for g in book.backends.values()],
            # a wide server's data-parallel ranks (its row in `backends` is the server as a whole)
            "ranks": [row(g, backend=unit_backend(g.name), rank=int(g.name.rpartition("@")[2]), runtime=g.runtime)
                      for g in book.ranks.values()],
            "runtimes": [row(g, task=g.task) for g in book.runtimes.values()],
            "arms": [row(g, route=g.route, weight=book.weights(g.route or "").get(g.name))
                     for g in book.arms.values()],
            # prefill/decode disaggregation: each pair (true TTFT, throughput, its legs' times) and each
            # topology of a disaggregated route (split against whole requests on the same traffic)
            "pairs": [row(g, route=g.route, prefill=g.name.partition(">")[0], decode=g.name.partition(">")[2],
                          **leg_figures(book.pair_legs.get(key), now, window_s))
                      for key, g in book.pairs.items()],
            "topologies": [row(g, route=g.route) for g in book.topologies.values()],
            "ab": self.ab(now, window_s),
            "history": history(book, now),
        }

    async def document_async(self, now: float, window_s: int) -> dict[str, Any]:
        key = (window_s, math.floor(now / AB_CACHE_S))
        if key not in self._ab_cache:
            inputs = self._ab_inputs(now, window_s)
            result = await asyncio.to_thread(self._analyse_all, inputs)
            self._ab_cache = {key: result}
        return self.document(now, window_s)

    def ab(self, now: float, window_s: int) -> list[dict[str, Any]]:
        key = (window_s, math.floor(now / AB_CACHE_S))
        cached = self._ab_cache.get(key)
        if cached is None:
            cached = self._analyse_all(self._ab_inputs(now, window_s))
            self._ab_cache = {key: cached}
        return cached

    def _ab_inputs(self, now: float, window_s: int) -> list[tuple[str, list[ArmData]]]:
        book = self.book
        routes: dict[str, list[Group]] = {}
        for (route, _), g in book.arms.items():
            routes.setdefault(route, []).append(g)
        out = []
        for route, groups in routes.items():
            weights = book.weights(route)
            out.append((route, [self._arm_data(g, now, window_s, weights.get(g.name, 0.0)) for g in groups]))
        return out

    def _analyse_all(self, inputs: Sequence[tuple[str, list[ArmData]]]) -> list[dict[str, Any]]:
        return [{"route": route, **analyse(arms, min_n=self.min_n, seed=self.seed)} for route, arms in inputs]

    def _arm_data(self, g: Group, now: float, window_s: int, weight: float) -> ArmData:
        view = g.series.view(now, window_s)
        fine = g.series.view(now, min(window_s, FINE_BUCKETS))
        cur = math.floor(now)
        per_second = {b.index: b.output_tokens for b in fine.buckets}  # generated in each second
        series = [per_second.get(i, 0.0) for i in range(cur - fine.span_s, cur)]
        return ArmData(
            name=g.name, weight=weight, requests=sum(b.requests for b in view.buckets),
            ttft_s=[v for b in view.buckets for v in b.ttft.values],
            tpot_s=[v for b in view.buckets for v in b.tpot.values],
            tokens_per_s_series=series,
            usd_per_hour=group_price(self.book.prices.get(n) for n in g.backends),
        )
