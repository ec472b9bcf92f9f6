"""What a process's admin surfaces call to read or change the whole gateway.

A single process is the whole gateway (`Local`): its own proxy, reloader and windows, plus, with a
store, the fleet's (shared weights, other replicas' windows). A worker under a supervisor is one of
several (`link.Remote`): every call goes to the hub, which applies it to every worker. The admin
endpoints (`admin/weights`, `admin/reload`, the comparison, `/admin/workers`) and SIGHUP see only
this protocol, so they behave the same with one worker or many.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..proxy.service import proxy_of
from ..state.generations import Generations
from ..state.reload import Reloaded, Reloader
from ..state.store import StoreDown
from ..stats import Comparer, StatsBook
from ..stats.export import export_book, merge
from .fleet import FleetStats, replica_row
from .overrides import SharedWeights, fingerprints

SCOPES = ("replica", "fleet")


class Coordinator(Protocol):
    def weights(self, model: str) -> dict[str, float]: ...

    async def set_weights(self, model: str, weights: Mapping[str, float]) -> dict[str, float]:
        """Apply everywhere this gateway runs; raises KeyError (not a split route), ValueError, or
        WeightsConflict (another replica wrote the route first: its weights are in force)."""
        ...

    async def reload(self) -> Reloaded:
        """Re-read the config everywhere; raises ReloadRejected."""
        ...

    async def compare(self, window: int, scope: str) -> dict[str, Any]: ...

    async def workers(self) -> dict[str, Any]: ...


class Local:
    """One process that is the whole gateway."""

    def __init__(
        self, generations: Generations, reloader: Reloader, book: StatsBook, comparer: Comparer, *,
        clock: Callable[[], float], served: Callable[[], float], shared: SharedWeights | None = None,
        fleet: FleetStats | None = None,
    ) -> None:
        self._generations = generations
        self._reloader = reloader
        self._book = book
        self._comparer = comparer
        self._clock = clock
        self._served = served
        self.shared = shared
        self.fleet = fleet
        self._fleet_docs: dict[tuple[int, int], dict[str, Any]] = {}
        self._fleet_comparer: Comparer | None = None
        self._started = clock()

    def weights(self, model: str) -> dict[str, float]:
        return proxy_of(self._generations.current).weights(model)

    async def set_weights(self, model: str, weights: Mapping[str, float]) -> dict[str, float]:
        proxy = proxy_of(self._generations.current)
        previous = proxy.weights(model)
        live = proxy.set_weights(model, weights)
        if self.shared is not None:
            await self.shared.put(model, live, previous=previous)  # WeightsConflict: the winner is in force
        return live

    async def apply_shared(self, model: str, weights: dict[str, float]) -> None:
        """Weights another replica set (polled from the store)."""
        proxy_of(self._generations.current).set_weights(model, weights)

    async def reload(self) -> Reloaded:
        before = fingerprints(self._generations.current.settings)
        done = await self._reloader.reload()
        after = fingerprints(self._generations.current.settings)
        if self.shared is not None:
            self.shared.forget({m for m in before if after.get(m) != before[m]})
        return done

    async def compare(self, window: int, scope: str) -> dict[str, Any]:
        now = self._clock()
        if scope != "fleet":
            return {**await self._comparer.document_async(now, window), "scope": "replica", "workers": 1}
        key = (window, math.floor(now))
        doc = self._fleet_docs.get(key)
        if doc is None:
            own = export_book(self._book, now)
            others = []
            if self.fleet is not None:
                try:
                    others = await self.fleet.others()
                except StoreDown:
                    others = []
            wall = time.time()
            replica = self.fleet.replica if self.fleet is not None else os.uname().nodename
            merged = merge([own, *others], now=now)
            if self._fleet_comparer is None:
                self._fleet_comparer = Comparer(merged)
            self._fleet_comparer.book = merged
            doc = {**await self._fleet_comparer.document_async(now, window), "scope": "fleet",
                   "workers": 1, "replicas": [{"replica": replica, "workers": 1, "age_s": 0.0},
                                              *(replica_row(o, wall) for o in others)]}
            self._fleet_docs = {key: doc}
        return {**doc, "now_s": now}

    async def workers(self) -> dict[str, Any]:
        """The hub's document (`Hub.workers_doc`) for a gateway of one process."""
        generation = self._generations.current.number
        return {"workers": [{"worker": 0, "pid": os.getpid(), "ready": True, "up_s": self._clock() - self._started,
                             "requests": self._served(), "generation": generation}],
                "expected": 1, "down": [], "restarts": 0, "generation": generation, "answered_by": 0}
