"""The composition root: the one place that builds and wires every part of the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from backends.registry import adapter_for

from .dashboard import DashboardHandlers
from .handlers import Handlers, error_middleware
from .health import HealthPoller
from .metrics import Recorder
from .pool import BackendState, Pool
from .proxy import Proxy
from .settings import Settings
from .stats import Comparer, LiveCollector, StatsBook, WeightsFn

SETTINGS = web.AppKey("settings", Settings)
POOL = web.AppKey("pool", Pool)
REGISTRY = web.AppKey("registry", CollectorRegistry)
STATS = web.AppKey("stats", StatsBook)


def build_pool(settings: Settings) -> Pool:
    states = [
        BackendState(config=b, adapter=adapter_for(b.runtime, chat_template=b.chat_template))
        for b in settings.backends
    ]
    return Pool(states, failure_threshold=settings.health.failure_threshold, cooldown_s=settings.health.cooldown_s)


async def build_app(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    weights: WeightsFn | None = None,
) -> web.Application:
    """Build the gateway application; must run inside the event loop that will serve it.

    `weights(route_model) -> {arm: weight}` is where the A/B statistics read the live split weights
    (default: as configured)."""
    registry = registry if registry is not None else CollectorRegistry()
    rng = rng if rng is not None else random.Random()
    pool = build_pool(settings)
    stats = StatsBook(settings, started_at=clock(), weights=weights)
    recorder = Recorder(registry, pool, clock=clock, observers=[stats.record])
    registry.register(LiveCollector(stats, clock))
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    session = aiohttp.ClientSession(connector=connector)
    proxy = Proxy(settings, pool, recorder, session, clock=clock, rng=rng)
    poller = HealthPoller(pool, session, interval_s=settings.health.interval_s, clock=clock, sleep=sleep)

    app = web.Application(middlewares=[error_middleware], client_max_size=settings.limits.max_body_bytes)
    app[SETTINGS] = settings
    app[POOL] = pool
    app[REGISTRY] = registry
    app[STATS] = stats
    Handlers(proxy, pool, registry).install(app)
    DashboardHandlers(Comparer(stats), clock).install(app)

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        await poller.poll_once()
        task = asyncio.create_task(poller.run(), name="health-poller")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await session.close()

    app.cleanup_ctx.append(lifetime)
    return app
