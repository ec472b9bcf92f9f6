"""The composition root: the one place that builds and wires every part of a gateway process, from the
config to the listening sockets. `process` only starts, signals and stops what this returns."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import resource
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry

from backends.base import Adapter
from backends.registry import adapter_for

from . import observability
from .access.auth import Guard
from .access.ratelimit import KeyLimiter, Limiter, LocalLimiter
from .access.secrets import CredentialedAdapter, Secrets, resolve_secrets
from .admin import backends as backends_admin
from .admin import reload as reload_admin
from .admin import weights as weights_admin
from .admin import workers as workers_admin
from .admin.dashboard import DashboardHandlers
from .admin.openapi import install_openapi
from .client import UpstreamPool
from .cluster import replicas
from .cluster.clock import gateway_clock
from .cluster.coordinator import Coordinator
from .cluster.link import WorkerLink
from .http.aiohttp_server import GatewayRunner
from .http.handlers import Handlers, error_middleware
from .http.native_front import Front
from .observability.metrics import Recorder
from .observability.process import SelfHealth
from .proxy.accounting import Accounting
from .proxy.dispatch import Dispatcher
from .proxy.service import Proxy
from .routing import RoutingState
from .settings import Settings
from .state.generations import Generation, Generations, LivePool
from .state.health import HealthPoller, Poller
from .state.outliers import OutlierRules
from .state.pool import BackendState, Pool
from .state.reload import Reloader
from .state.splits import Splits
from .stats import Comparer, LiveCollector, StatsBook, WeightsFn


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
    h = settings.health
    rules = OutlierRules(
        consecutive=h.failure_threshold, failure_rate=h.failure_rate, window_s=h.window_s, min_requests=h.min_requests,
        base_ejection_s=h.cooldown_s, max_ejection_s=h.max_ejection_s, max_ejected_share=h.max_ejected_share,
    )
    return Pool(states, rules=rules)


@dataclass
class Built:
    """A gateway, wired and not yet listening."""

    app: web.Application  # aiohttp's: every path but the native front's generation requests
    metrics_app: web.Application | None  # `/metrics` alone, when it has its own port
    dispatcher: Dispatcher
    generations: Generations
    reloader: Reloader
    health: SelfHealth
    upstream: UpstreamPool
    coordinator: Coordinator  # what admin writes and SIGHUP go through (one process, or every worker)
    registry: CollectorRegistry
    stats: StatsBook


async def build(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    rng: random.Random | None = None,
    clock: Callable[[], float] = gateway_clock,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    weights: WeightsFn | None = None,
    secrets: Secrets | None = None,
    config_path: str | Path | None = None,
    link: WorkerLink | None = None,
) -> Built:
    """Build the gateway; must run inside the event loop that will serve it.

    `weights(route_model) -> {arm: weight}` is where the A/B statistics read the live split weights
    (default: the live ones). `secrets` default to resolving the config's references now (raises
    ConfigError). With `config_path`, SIGHUP and `POST /admin/reload` re-read that file. With `link`
    (a worker under `--workers N`), health, limits, admin writes, /metrics and the comparison are the
    supervisor's, for every worker (`cluster.hub`); with `state`, limits and weights are the fleet's."""
    registry = registry if registry is not None else CollectorRegistry()
    rng = rng if rng is not None else random.Random()
    secrets = secrets if secrets is not None else resolve_secrets(settings)
    generations = Generations()
    if weights is None:  # the A/B statistics read the live split weights of the current generation

        def weights(model: str) -> dict[str, float]:
            return generations.current.proxy.weights(model)

    stats = StatsBook(settings, started_at=clock(), weights=weights)
    routing = RoutingState()  # prefix memory and latency estimators outlive config generations
    splits = Splits()  # so do live A/B weights, while a route's split stays as configured
    arms = observability.ArmMetrics(registry)
    recorder = Recorder(registry, LivePool(generations), clock=clock, observers=[stats.record, arms.record])
    limiter: Limiter = LocalLimiter(KeyLimiter(clock))
    if link is not None:
        limiter = link.limiter(limiter)
    shared = replicas.Shared.build(settings, registry, limiter, supervised=link is not None)  # if `state` is set
    guard = Guard(generations, shared.limiter, registry)
    accounting = Accounting(recorder, routing, clock=clock, charge_key=guard.charge)
    registry.register(LiveCollector(stats, clock))
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))  # probes, scrapes
    upstream = UpstreamPool(connect_timeout_s=settings.timeouts.connect_s)  # the request path

    def build_generation(settings: Settings, secrets: Secrets, number: int) -> Generation:
        if number > 1:
            stats.reconfigure(settings)  # new backends and arms join the live comparison
        pool = build_pool(settings, secrets)
        upstream.connect_timeout_s = settings.timeouts.connect_s
        splits.retain([r.model for r in settings.routes if r.split is not None])
        proxy = Proxy(
            settings, pool, recorder, upstream, accounting, clock=clock, rng=rng, routing=routing,
            throughput=stats.peak_output_tps, splits=splits,
        )
        poller: Poller = (
            HealthPoller(pool, session, interval_s=settings.health.interval_s, clock=clock, sleep=sleep)
            if link is None else link.poller(pool, clock)  # the supervisor probes, once for all workers
        )
        for b in settings.backends:  # born at 0, so that increase() sees a first ejection
            recorder.ejections.labels(b.name, b.runtime.value)
        return Generation(number, settings, secrets, pool, proxy, poller)

    generations.install(build_generation(settings, secrets, 1))
    reloader = Reloader(generations, build_generation, config_path)
    dispatcher = Dispatcher(generations, guard, accounting, clock=clock)

    app = web.Application(
        middlewares=[_marked(error_middleware), _marked(guard.middleware)],
        client_max_size=settings.limits.max_body_bytes,
    )
    health = observability.install(app, registry, backends=lambda: generations.current.settings.backends)
    health.connections.add("upstream", lambda: upstream.open_connections)
    separate_metrics = settings.listen.metrics_port is not None
    handlers = Handlers(generations, dispatcher, registry, body_timeout_s=settings.limits.body_timeout_s,
                        serve_metrics=not separate_metrics and link is None)
    handlers.install(app)
    comparer = Comparer(stats)

    def served() -> float:
        return math.fsum(c.value for c in recorder.requests.children().values())

    coordinator: Coordinator
    metrics_handler: Callable[[web.Request], Awaitable[web.Response]]
    if link is None:
        coordinator = shared.local(generations, reloader, stats, comparer, clock=clock, served=served)
        metrics_handler = handlers.metrics
    else:
        remote = link.attach(replicas.worker_parts(registry, stats, generations, reloader, clock, served))
        coordinator, metrics_handler = remote, replicas.metrics_handler(remote)
        if not separate_metrics:
            app.router.add_get("/metrics", metrics_handler)
    backends_admin.install(app, generations)
    reload_admin.install(app, coordinator)
    weights_admin.install(app, coordinator)
    workers_admin.install(app, coordinator.workers)
    install_openapi(app)
    DashboardHandlers(comparer, clock, documents=coordinator.compare).install(app)
    metrics_app = None
    if separate_metrics:
        metrics_app = web.Application(middlewares=[_marked(error_middleware)])
        metrics_app.router.add_get("/metrics", metrics_handler)

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        await shared.start()  # the fleet's weights are in force before the first request
        if link is not None:
            await link.resync()
        first = generations.current
        await first.poller.poll_once()
        first.start()
        yield
        await generations.current.stop()
        for old in generations.retired:
            await old.stop()
        await shared.close()
        await session.close()
        await upstream.close()

    app.cleanup_ctx.append(lifetime)
    return Built(app, metrics_app, dispatcher, generations, reloader, health, upstream, coordinator, registry,
                 stats)


def _raise_open_file_limit() -> None:
    """Every open stream holds two sockets (client and backend): lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class Running:
    """A listening gateway process."""

    built: Built
    url: str
    metrics_url: str | None
    runners: list[web.AppRunner] = field(default_factory=list)
    front: Front | None = None
    listener: asyncio.Server | None = None

    async def stop(self, drain_timeout_s: float) -> None:
        """Stop listening, let running requests finish (up to the drain timeout), then clean up."""
        if self.listener is not None and self.front is not None:
            self.listener.close()
            await self.front.shutdown(drain_timeout_s)
        for runner in self.runners:  # stops listening, closes idle connections, waits for running handlers
            await runner.cleanup()


async def start(
    settings: Settings, *, host: str, port: int, reuse_port: bool = False, config_path: str | None = None,
    link: WorkerLink | None = None,
) -> Running:
    """Build the gateway and listen: the native front (or aiohttp alone) on `host:port`, and the
    metrics port when configured. Limits are read once, here, for both fronts: changing them needs a
    restart (a reload says so in `restart_required`)."""
    built = await build(settings, config_path=config_path, link=link)
    limits = settings.limits
    runner = GatewayRunner(
        built.app, header_timeout_s=limits.header_timeout_s, handler_cancellation=True, access_log=None,
        shutdown_timeout=limits.drain_timeout_s, max_line_size=limits.max_header_bytes,
        max_field_size=limits.max_header_bytes, lingering_time=1.0,
    )
    await runner.setup()
    _raise_open_file_limit()
    reuse = reuse_port or None
    running = Running(built, "", None, [runner])
    if settings.listen.front == "native":
        assert runner.server is not None
        running.front = Front(built.dispatcher, runner.server, lambda: limits)
        running.listener = await asyncio.get_running_loop().create_server(
            running.front, host, port, reuse_port=reuse, backlog=settings.listen.backlog
        )
        bound = running.listener.sockets[0].getsockname()[1]
    else:
        site = web.TCPSite(runner, host, port, reuse_port=reuse, backlog=settings.listen.backlog)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
    running.url = f"http://{host}:{bound}"
    server = runner.server
    assert server is not None
    front = running.front
    built.health.connections.add(
        "client", lambda: len(server.connections) + (len(front.connections) if front is not None else 0)
    )
    if built.metrics_app is not None and settings.listen.metrics_port is not None:
        metrics_runner = web.AppRunner(built.metrics_app, access_log=None)
        await metrics_runner.setup()
        await web.TCPSite(metrics_runner, host, settings.listen.metrics_port, reuse_port=reuse).start()
        running.metrics_url = f"http://{host}:{metrics_runner.addresses[0][1]}/metrics"
        running.runners.append(metrics_runner)
    return running
