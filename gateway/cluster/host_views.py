"""The hub's views of the whole host: one /metrics page and one comparison, merged from its workers'.

- /metrics: every worker's families (`collect`) merged by the rules they declare (`scrape`), with
  the hub's own; asked at each scrape and every `BASELINE_S` besides, so that a worker that crashes
  loses only what it counted since.
- the comparison (`/admin/compare`, and this host's share of the fleet's): every worker's windows
  (`stats`, `stats.export`) merged. The last export of each worker is kept (`windows`), refreshed
  as often as the metrics (reservoirs thinned as the fleet's), and a retired worker's stays in the
  merge until it ages out; a worker that does not answer in time counts with its last export.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from ..state.store import StoreDown
from ..stats import Comparer
from ..stats.export import Export, export_book, merge
from .fleet import MAX_SAMPLES, FleetStats, replica_row
from .scrape import ScrapeMerger, dump
from .windows import WorkerWindows

BASELINE_S = 5.0  # besides every scrape and comparison: bounds what a crashed worker's counts lose


class Worker(Protocol):
    @property
    def slot(self) -> int: ...

    @property
    def source(self) -> str: ...


Each = Callable[..., Awaitable[list[tuple[Any, Any]]]]  # (method, body, timeout_s=) -> [(worker, answer)]


class HostViews:
    """`each(method, body, timeout_s=)` asks every live worker; `current(worker)` says whether an
    answer still comes from a live worker (not one retired meanwhile)."""

    def __init__(self, *, each: Each, current: Callable[[Any], bool], registry: CollectorRegistry,
                 clock: Callable[[], float], replica: str) -> None:
        self._each = each
        self._current = current
        self._registry = registry
        self._clock = clock
        self._replica = replica
        self.fleet: FleetStats | None = None
        self.merger = ScrapeMerger()
        self.windows = WorkerWindows()
        self._asked_at: float | None = None  # when the workers' windows were last asked for
        self._docs: dict[tuple[str, int, int], dict[str, Any]] = {}
        self._comparers: dict[str, Comparer] = {}

    def retire(self, worker: Worker) -> None:
        """`worker` is gone: its counters stay in the sums, its last windows until they age out."""
        self.merger.retire(worker.source)
        self.windows.retire(worker.source, self._clock())

    async def refresh(self) -> None:
        """The baseline: every worker's families, and their windows unless a comparison or the fleet
        asked for them lately."""
        await self._scrape()
        if self._asked_at is None or self._clock() - self._asked_at >= BASELINE_S / 2:
            await self._exports(MAX_SAMPLES)

    # -- metrics ------------------------------------------------------------------------------------

    async def _scrape(self) -> None:
        for worker, answer in await self._each("collect", timeout_s=5.0):
            if isinstance(answer, list) and self._current(worker):
                self.merger.update(worker.source, answer, worker=str(worker.slot))
        self.merger.update("hub", dump(self._registry), worker="hub")

    async def metrics(self, accept: str) -> tuple[bytes, str]:
        """The whole gateway's /metrics (a worker that does not answer in time contributes what it
        reported last)."""
        await self._scrape()
        return self.merger.render(accept)

    # -- comparison ---------------------------------------------------------------------------------

    async def _exports(self, max_samples: int | None) -> tuple[list[Export], int]:
        """(every worker's last windows, retired ones included; how many of them are serving)."""
        answers = await self._each("stats", {"max_samples": max_samples}, timeout_s=30.0)
        now = self._asked_at = self._clock()
        for worker, answer in answers:
            if isinstance(answer, dict) and self._current(worker):
                self.windows.update(worker.source, answer)
        exports = self.windows.exports(now)
        return exports, len(exports) - len(self.windows.retired(now))

    async def host_export(self, max_samples: int | None) -> Export:
        now = self._clock()
        exports, _ = await self._exports(max_samples)
        return export_book(merge(exports, now=now), now, max_samples=max_samples)

    async def compare(self, window: int, scope: str) -> dict[str, Any]:
        now = self._clock()
        key = (scope, window, math.floor(now))
        doc = self._docs.get(key)
        if doc is not None:
            return {**doc, "now_s": now}
        exports, serving = await self._exports(None)
        extra: dict[str, Any] = {"scope": scope, "workers": serving, "retired_workers": len(exports) - serving}
        if scope == "fleet":
            own = export_book(merge(exports, now=now), now)
            others: list[Export] = []
            if self.fleet is not None:
                with contextlib.suppress(StoreDown):
                    others = await self.fleet.others()
            wall = time.time()
            extra["replicas"] = [{"replica": self._replica, "workers": serving, "age_s": 0.0},
                                 *(replica_row(o, wall) for o in others)]
            exports = [own, *others]
        comparer = self._comparers.get(scope)
        merged = merge(exports, now=now)
        if comparer is None:
            comparer = self._comparers[scope] = Comparer(merged)
        comparer.book = merged  # (its A/B analyses are kept for 5 s, as a worker's own are)
        doc = {**await comparer.document_async(now, window), **extra}
        self._docs = {k: v for k, v in self._docs.items() if k[2] == key[2]}
        self._docs[key] = doc
        return doc
