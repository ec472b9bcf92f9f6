"""What one gateway process wires in to share state with other replicas (the composition root calls
this; it builds nothing when `state` is not configured, so a lone replica runs exactly as without it).

With `state.redis_url`, every process gets a `Store`, and its rate limits lease from the fleet's
buckets (`access.shared_limits`; while the store is down, from the host's or its own). A process that is the whole
gateway (no `--workers`) also shares its weights and publishes its windows itself; under a
supervisor, the hub does that for all workers.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry

from ..access.leased import LeasedLimiter
from ..access.ratelimit import Limiter
from ..access.shared_limits import RedisSource
from ..errors import GatewayError
from ..settings import Settings
from ..state.generations import Generations
from ..state.reload import Reloader
from ..state.store import Store
from ..stats import Comparer, StatsBook
from ..stats.export import Export, export_book
from .channel import ChannelClosed, RemoteError
from .coordinator import Local
from .fleet import FleetStats
from .hub import replica_name
from .link import Remote, WorkerParts
from .overrides import SharedWeights, fingerprints


@dataclass
class Shared:
    settings: Settings
    limiter: Limiter
    store: Store | None = None
    coordinator: Local | None = None

    @classmethod
    def build(cls, settings: Settings, registry: CollectorRegistry, limiter: Limiter, *, supervised: bool,
              clock: Callable[[], float]) -> Shared:
        """`supervised`: a worker of a supervisor (whose hub reports the store's outages). `limiter`
        decides while the store is down."""
        if settings.state is None:
            return cls(settings, limiter)
        store = Store(settings.state, registry=registry, report=not supervised)
        source = RedisSource(store, holder=f"{replica_name(settings)}/{os.getpid()}")
        leased = LeasedLimiter(source, limiter, clock=clock, patience_s=settings.state.timeout_s,
                               fell_back=lambda: store.fell_back("limits"))
        return cls(settings, leased, store)

    def local(
        self, generations: Generations, reloader: Reloader, book: StatsBook, comparer: Comparer, *,
        clock: Callable[[], float], served: Callable[[], float],
    ) -> Local:
        """The coordinator of a process that is the whole gateway (sharing through the store, if any)."""
        local = self.coordinator = Local(generations, reloader, book, comparer, clock=clock, served=served)
        state, store = self.settings.state, self.store
        if state is not None and store is not None:
            replica = replica_name(self.settings)
            local.shared = SharedWeights(
                store, replica=replica, apply=local.apply_shared,
                fingerprints=lambda: fingerprints(generations.current.settings), interval_s=state.sync_interval_s,
            )

            async def export(max_samples: int | None) -> Export:
                return export_book(book, clock(), max_samples=max_samples)

            local.fleet = FleetStats(store, replica=replica, export=export, interval_s=state.publish_interval_s,
                                     workers=lambda: 1)
        return local

    async def start(self) -> None:
        if self.store is None:
            return
        await self.store.start()
        if self.coordinator is not None:
            for part in (self.coordinator.shared, self.coordinator.fleet):
                if part is not None:
                    await part.start()

    async def close(self) -> None:
        """Give the leases back (the fleet's, then the host's), stop sharing."""
        limiter: Limiter | None = self.limiter
        while isinstance(limiter, LeasedLimiter):
            await limiter.close()
            limiter = limiter.fallback if limiter.fallback is not limiter.stand_in else None
        if self.store is None:
            return
        if self.coordinator is not None:
            for part in (self.coordinator.fleet, self.coordinator.shared):
                if part is not None:
                    await part.close()
        await self.store.close()


def worker_parts(
    registry: CollectorRegistry, book: StatsBook, generations: Generations, reloader: Reloader,
    clock: Callable[[], float], served: Callable[[], float],
) -> WorkerParts:
    return WorkerParts(registry, book, generations, reloader, clock, served)


class MetricsUnavailable(GatewayError):
    status = 503
    type = "server_error"
    code = "metrics_unavailable"


def metrics_handler(remote: Remote) -> Callable[[web.Request], Awaitable[web.Response]]:
    """`/metrics` of a worker: the whole gateway's page, merged by the supervisor."""

    async def metrics(request: web.Request) -> web.Response:
        try:
            body, content_type = await remote.metrics(request.headers.get("Accept", ""))
        except (ChannelClosed, RemoteError, TimeoutError):
            raise MetricsUnavailable("The supervisor did not answer; the whole gateway's metrics are "
                                     "unavailable (try again).") from None
        return web.Response(body=body, headers={"Content-Type": content_type})

    return metrics
