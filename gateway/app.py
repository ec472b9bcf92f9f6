"""The composition root: the one place that builds and wires every part of the gateway."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry

from backends.base import Adapter
from backends.registry import adapter_for

from .access.auth import Dispatch, Guard
from .access.ratelimit import KeyLimiter
from .access.secrets import CredentialedAdapter, Secrets, resolve_secrets
from .admin import weights as weights_admin
from .admin.dashboard import DashboardHandlers
from .admin.openapi import install_openapi
from .client.pool import UpstreamPool
from .http.handlers import Handlers, error_middleware
from .observability.metrics import Recorder
from .proxy.service import Proxy
from .routing import RoutingState
from .settings import Settings
from .state.generations import Generation, Generations, LivePool
from .state.health import HealthPoller
from .state.pool import BackendState, Pool
from .state.reload import Reloader
from .stats import Comparer, LiveCollector, StatsBook, WeightsFn

SETTINGS = web.AppKey("settings", Settings)
POOL = web.AppKey("pool", Pool)
REGISTRY = web.AppKey("registry", CollectorRegistry)
STATS = web.AppKey("stats", StatsBook)
GENERATIONS = web.AppKey("generations", Generations)
RELOADER = web.AppKey("reloader", Reloader)
METRICS_APP = web.AppKey("metrics_app", web.Application)
DISPATCH: web.AppKey[Dispatch] = web.AppKey("dispatch")  # the generation endpoints, for the native front


def _marked(middleware: Middleware) -> Middleware:
    """aiohttp recognises a middleware by an attribute it sets on the function, which compiled
    functions (`make native`) cannot carry: the mark goes on this plain wrapper instead."""

    @web.middleware
    async def marked(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await middleware(request, handler)

    return marked


def build_pool(settings: Settings, secrets: Secrets | None = None) -> Pool:
    keys = secrets.backend_keys if secrets is not None else {}
    states = []
    for b in settings.backends:
        adapter: Adapter = adapter_for(b.runtime, chat_template=b.chat_template)
        if b.name in keys:
            adapter = CredentialedAdapter(adapter, keys[b.name])
        states.append(BackendState(config=b, adapter=adapter))
    return Pool(states, failure_threshold=settings.health.failure_threshold, cooldown_s=settings.health.cooldown_s)


async def build_app(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    weights: WeightsFn | None = None,
    secrets: Secrets | None = None,
    config_path: str | Path | None = None,
) -> web.Application:
    """Build the gateway application; must run inside the event loop that will serve it.

    `weights(route_model) -> {arm: weight}` is where the A/B statistics read the live split weights
    (default: as configured). `secrets` default to resolving the config's references now (raises
    ConfigError). With `config_path`, SIGHUP and `POST /admin/reload` re-read that file."""
    registry = registry if registry is not None else CollectorRegistry()
    rng = rng if rng is not None else random.Random()
    secrets = secrets if secrets is not None else resolve_secrets(settings)
    generations = Generations()
    if weights is None:  # the A/B statistics read the live split weights of the current generation

        def weights(model: str) -> dict[str, float]:
            return generations.current.proxy.weights(model)

    stats = StatsBook(settings, started_at=clock(), weights=weights)
    routing = RoutingState()  # prefix memory and latency estimators outlive config generations

    limiter = KeyLimiter(clock)
    recorder = Recorder(registry, LivePool(generations), clock=clock, observers=[stats.record])
    guard = Guard(generations, limiter, recorder, registry, clock=clock)
    recorder.observers.append(guard.observe)
    registry.register(LiveCollector(stats, clock))
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    session = aiohttp.ClientSession(connector=connector)  # health probes and load scrapes
    upstream = UpstreamPool(connect_timeout_s=settings.timeouts.connect_s)  # the request path

    def build_generation(settings: Settings, secrets: Secrets, number: int) -> Generation:
        if number > 1:
            stats.reconfigure(settings)  # new backends and arms join the live comparison
        pool = build_pool(settings, secrets)
        upstream.connect_timeout_s = settings.timeouts.connect_s
        proxy = Proxy(
            settings, pool, recorder, upstream, clock=clock, rng=rng, routing=routing,
            throughput=stats.peak_output_tps,
        )
        poller = HealthPoller(pool, session, interval_s=settings.health.interval_s, clock=clock, sleep=sleep)
        return Generation(number, settings, secrets, pool, proxy, poller)

    generations.install(build_generation(settings, secrets, 1))
    reloader = Reloader(generations, build_generation, config_path)

    app = web.Application(
        middlewares=[_marked(error_middleware), _marked(guard.middleware)],
        client_max_size=settings.limits.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[POOL] = generations.current.pool
    app[REGISTRY] = registry
    app[STATS] = stats
    app[GENERATIONS] = generations
    app[RELOADER] = reloader
    separate_metrics = settings.listen.metrics_port is not None
    handlers = Handlers(generations, registry, serve_metrics=not separate_metrics)
    handlers.install(app)
    app[DISPATCH] = guard.guarded(handlers.generate)
    reloader.install(app)
    weights_admin.install(app, lambda: generations.current.proxy)
    install_openapi(app)
    DashboardHandlers(Comparer(stats), clock).install(app)
    if separate_metrics:
        metrics_app = web.Application(middlewares=[_marked(error_middleware)])
        metrics_app.router.add_get("/metrics", handlers.metrics)
        app[METRICS_APP] = metrics_app

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        first = generations.current
        await first.poller.poll_once()
        first.start()
        yield
        await generations.current.stop()
        for old in generations.retired:
            await old.stop()
        await session.close()
        await upstream.close()

    app.cleanup_ctx.append(lifetime)
    return app
