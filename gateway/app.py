"""The composition root: the one place that builds and wires every part of a gateway process, from the
config to the listening sockets. `process` only starts, signals and stops what this returns."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
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

from . import observability, tracing
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
from .discovery import DiscoveryEntry, DiscoveryMetrics, Source, make_source
from .http.aiohttp_server import GatewayServer, track_responses
from .http.handlers import Handlers, error_middleware
from .http.native_front import Front
from .kvcache import KvCaches, KvIntake
from .kvcache.collector import KvCollector
from .kvcache.intake import backend_headers
from .observability.metrics import Recorder
from .observability.pd import PdMetrics
from .observability.process import SelfHealth
from .observability.ranks import RankMetrics
from .picker.exchange import Picking
from .picker.server import PickerServer
from .proxy.accounting import Accounting
from .proxy.dispatch import Dispatcher
from .proxy.service import Proxy, proxy_of
from .routing import RoutingState
from .routing.response_owners import ResponseOwners
from .settings import Backend, Settings
from .state.generations import Generation, Generations, LivePool
from .state.health import HealthPoller, Poller
from .state.health_feed import probed_by_worker
from .state.membership import Membership
from .state.outliers import OutlierRules
from .state.pool import STATIC, BackendState, Pool, candidate_sets
from .state.reload import Checked, Reloader
from .state.splits import Splits
from .stats import Comparer, LiveCollector, StatsBook, WeightsFn
from .tokenize import resolve_tokenizers

KEEPALIVE_S = 75.0  # idle keep-alive connections close after this long, on both fronts


def _marked(middleware: Middleware) -> Middleware:
    """aiohttp recognises a middleware by an attribute it sets on the function, which compiled
    functions (`make native`) cannot carry: the mark goes on this plain wrapper instead."""

    @web.middleware
    async def marked(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await middleware(request, handler)

    return marked


def backend_state(config: Backend, secrets: Secrets | None = None, *, source: str | None = None) -> BackendState:
    """A static backend's state (optimistic until its first probe), or, with `source` (its discovery
    entry), a discovered one's: not ready until its first passing probe, with the entry's key."""
    if source is None:
        key = secrets.backend_keys.get(config.name) if secrets is not None else None
    else:
        key = secrets.discovery_keys.get(source) if secrets is not None else None
    adapter: Adapter = adapter_for(config.runtime, chat_template=config.chat_template)
    if key is not None:
        adapter = CredentialedAdapter(adapter, key)
    if source is None:
        return BackendState(config=config, adapter=adapter)
    return BackendState(config=config, adapter=adapter, probe_ok=False, source=source)


def build_pool(
    settings: Settings, secrets: Secrets | None = None, discovered: list[tuple[Backend, str]] | None = None
) -> Pool:
    """The static backends plus `discovered` ones (config, entry name) as they are now."""
    states = [backend_state(b, secrets) for b in settings.backends]
    taken = {s.name for s in states}
    states += [backend_state(b, secrets, source=entry) for b, entry in discovered or () if b.name not in taken]
    h = settings.health
    rules = OutlierRules(
        consecutive=h.failure_threshold, failure_rate=h.failure_rate, window_s=h.window_s, min_requests=h.min_requests,
        base_ejection_s=h.cooldown_s, max_ejection_s=h.max_ejection_s, max_ejected_share=h.max_ejected_share,
    )
    # the outlier guards are judged per route and per arm (the sets requests choose from)
    return Pool(states, rules=rules, groups=[e.name for e in settings.discovery], sets=candidate_sets(settings.routes))


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
    guard: Guard
    membership: Membership  # discovered backends (and their sources' tasks)
    coordinator: Coordinator  # what admin writes and SIGHUP go through (one process, or every worker)
    registry: CollectorRegistry
    stats: StatsBook
    picking: Picking  # the Endpoint Picker's entry (served when `endpoint_picker` is configured)


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
    discovery_source: Callable[[DiscoveryEntry], Source] | None = None,
    link: WorkerLink | None = None,
) -> Built:
    """Build the gateway; must run inside the event loop that will serve it.

    `weights(route_model) -> {arm: weight}` is where the A/B statistics read the live split weights
    (default: the live ones). `secrets` default to resolving the config's references now (raises
    ConfigError). With `config_path`, SIGHUP and `POST /admin/reload` re-read that file.
    `discovery_source(entry)` makes each discovery entry's source (default: DNS or Kubernetes, on
    this clock and sleep). With `link` (a worker under `--workers N`), health, limits, admin writes,
    /metrics and the comparison are the supervisor's, for every worker (`cluster.hub`); with `state`,
    limits and weights are the fleet's."""
    registry = registry if registry is not None else CollectorRegistry()
    rng = rng if rng is not None else random.Random()
    secrets = secrets if secrets is not None else resolve_secrets(settings)
    generations = Generations()
    if weights is None:  # the A/B statistics read the live split weights of the current generation

        def weights(model: str) -> dict[str, float]:
            return proxy_of(generations.current).weights(model)

    stats = StatsBook(settings, started_at=clock(), weights=weights)
    kv_caches = KvCaches(clock=clock)  # the engines' own caches, from their KV events
    routing = RoutingState(engines=kv_caches)  # prefix memory and latency estimators outlive config generations
    splits = Splits()  # so do live A/B weights, while a route's split stays as configured
    owners = ResponseOwners()  # and which backend stores which response
    arms = observability.ArmMetrics(registry)
    ranks = RankMetrics(registry, LivePool(generations))  # per data-parallel rank (`observability/ranks.py`)
    # one per process: every worker and replica exports its own spans (off: None, and no SDK loaded)
    tracer = tracing.build(settings, throughput=stats.peak_output_tps, registry=registry)
    access = [observability.access_log.record] if settings.listen.access_log else []
    recorder = Recorder(registry, LivePool(generations), clock=clock,
                        observers=[stats.record, arms.record, ranks.record, *access])
    # a worker leases from its supervisor's buckets (`cluster.hub_limits`); with `state`, from Redis first
    limiter: Limiter = LocalLimiter(KeyLimiter(clock)) if link is None else link.limiter(clock)
    shared = replicas.Shared.build(settings, registry, limiter, supervised=link is not None, clock=clock)
    guard = Guard(generations, shared.limiter, registry)
    pd = PdMetrics(registry)  # prefill/decode disaggregation's legs and pairs (`observability/pd.py`)
    accounting = Accounting(recorder, routing, clock=clock, charge_key=guard.charge, pd=pd)
    registry.register(LiveCollector(stats, clock))
    registry.register(KvCollector(kv_caches))
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))  # probes, scrapes
    upstream = UpstreamPool(connect_timeout_s=settings.timeouts.connect_s)  # the request path
    # under `--workers N`, what only one process may hear comes through the supervisor (`kvcache.relay`)
    kv_intake = KvIntake(kv_caches, session, sleep=sleep, relay_dir=None if link is None else link.directory)
    if discovery_source is None:

        def discovery_source(entry: DiscoveryEntry) -> Source:  # backoff jitter: each its own generator
            return make_source(entry, sleep=sleep, clock=clock)

    def members_changed(generation: Generation) -> None:
        """The pool's backends changed (discovery, a reload): the live comparison and the routing
        memory follow (a backend's history stays while it is in the pool, and while a discovered
        one that left is remembered, for its return)."""
        pool = generation.pool
        remembered = membership.remembered()
        stats.reconfigure(generation.settings, backends=[s.config for s in pool], pools=pool.groups(),
                          keep=remembered)
        routing.retain([*(s.name for s in pool), *remembered])

    membership = Membership(
        generations, make_state=lambda b, entry, g: backend_state(b, g.secrets, source=entry),
        make_source=discovery_source, metrics=DiscoveryMetrics(registry), clock=clock, sleep=sleep,
        on_change=members_changed,
    )

    def build_generation(checked: Checked, number: int) -> Generation:
        """A generation's parts, changing nothing the app shares (a reload's prepare phase)."""
        settings, secrets = checked.settings, checked.secrets
        # discovered backends outlive generations: each starts with them (as the new config makes them)
        pool = build_pool(settings, secrets, membership.discovered(settings))
        proxy = Proxy(
            settings, pool, recorder, upstream, accounting, clock=clock, rng=rng, routing=routing,
            throughput=stats.peak_output_tps, splits=splits, owners=owners, tokenizers=checked.tokenizers, pd=pd,
        )
        # a worker under `--workers N` applies its supervisor's probes (once for all workers), and
        # probes only the backends its own discovery found
        own = HealthPoller(pool, session, interval_s=settings.health.interval_s, clock=clock, sleep=sleep,
                           probes=None if link is None else probed_by_worker)
        poller: Poller = own if link is None else link.poller(pool, clock, own, number)
        return Generation(number, settings, secrets, pool, proxy, poller)

    def activate(generation: Generation) -> None:
        """What the app shares adopts a generation about to be installed (a reload's commit)."""
        settings, pool = generation.settings, generation.pool
        reloaded = membership.newest is not None
        membership.configure(settings)
        found = {b.name: (b, entry) for b, entry in membership.discovered()}
        have = {s.name for s in pool}
        for gone in [s.name for s in pool if s.source != STATIC and s.name not in found]:  # left since it was built
            pool.drain(gone, clock())
            pool.remove(gone)
        for name, (b, entry) in found.items():  # found since it was built
            if name not in have:
                pool.join(backend_state(b, generation.secrets, source=entry))
        membership.adopt(generation)
        upstream.connect_timeout_s = settings.timeouts.connect_s
        splits.keep(proxy_of(generation).live_splits)
        kv_intake.reconcile(settings.backends, backend_headers(generation.secrets.backend_keys))
        for b in settings.backends:  # born at 0, so that increase() sees a first ejection
            recorder.ejections.labels(b.name, b.runtime.value)
        if reloaded:
            members_changed(generation)  # new backends and arms join the live comparison

    first = build_generation(
        Checked(settings, secrets, resolve_tokenizers(settings, source=str(config_path or "<config>")),
                str(config_path or "<config>")),
        1 if link is None else link.generation,
    )
    activate(first)
    generations.install(first)
    reloader = Reloader(generations, build_generation, config_path, activate=activate)
    dispatcher = Dispatcher(generations, guard, accounting, clock=clock, tracing=tracer)
    picking = Picking(generations, guard, accounting, clock=clock)  # Envoy's requests: the same accounting

    app = web.Application(
        middlewares=[_marked(error_middleware), _marked(guard.middleware)],
        client_max_size=settings.limits.max_body_bytes,
    )
    health = observability.install(app, registry, backends=lambda: [s.config for s in generations.current.pool])
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
        current = generations.current  # (a worker may have adopted a newer one in `resync`, started)
        if current.task is None:
            await current.poller.poll_once()
            current.start()
        membership.start()  # discovered backends join as their sources answer
        yield
        await membership.stop()
        await generations.current.stop()
        for old in generations.retired:
            await old.stop()
        await kv_intake.close()
        await shared.close()
        await session.close()
        await upstream.close()
        if tracer is not None:
            await tracer.close()  # what is queued goes, for a few seconds at most

    app.cleanup_ctx.append(lifetime)
    return Built(app, metrics_app, dispatcher, generations, reloader, health, upstream, guard, membership,
                 coordinator, registry, stats, picking)


def _raise_open_file_limit() -> None:
    """Every open stream holds two sockets (client and backend): lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def loopback_only(listener: asyncio.Server) -> bool:
    """Whether every address the listener is bound to is a loopback one (127.0.0.0/8, ::1)."""
    addresses = [sock.getsockname()[0] for sock in listener.sockets]
    try:
        return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    except ValueError:  # not an IP socket
        return False


@dataclass
class Running:
    """A listening gateway process."""

    built: Built
    url: str
    metrics_url: str | None
    listener: asyncio.Server
    server: GatewayServer  # aiohttp's connections: every request the native front does not serve
    runners: list[web.AppRunner] = field(default_factory=list)
    front: Front | None = None
    picker: PickerServer | None = None  # the Endpoint Picker's gRPC server, when configured
    picker_port: int | None = None

    async def stop(self, drain_timeout_s: float) -> None:
        """Stop listening, let running requests finish (up to the drain timeout), then clean up."""
        self.listener.close()
        self.server.pre_shutdown()  # idle aiohttp connections close; running requests finish
        drains = [self.server.shutdown(drain_timeout_s)]
        if self.picker is not None:
            drains.append(self.picker.stop(drain_timeout_s))
        if self.front is not None:
            drains.append(self.front.shutdown(drain_timeout_s))
        await asyncio.gather(*drains)
        for runner in self.runners:  # the applications' cleanup (and the metrics port's server)
            await runner.cleanup()


async def start(
    settings: Settings, *, host: str, port: int, reuse_port: bool = False, config_path: str | None = None,
    link: WorkerLink | None = None,
) -> Running:
    """Build the gateway and listen: the native front (or aiohttp alone) on `host:port`, and the
    metrics port when configured. Limits are read once, here, for both fronts: changing them needs a
    restart (a reload says so in `restart_required`). Without an admin token, admin writes are open
    only when every listening address is a loopback one."""
    built = await build(settings, config_path=config_path, link=link)
    limits = settings.limits
    track_responses(built.app)
    runner = web.AppRunner(built.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    server = GatewayServer(
        runner, limits=limits, refused=built.dispatcher.refused, access_log=None, lingering_time=1.0,
        keepalive_timeout=KEEPALIVE_S,
    )
    _raise_open_file_limit()
    reuse = reuse_port or None
    front = None
    factory: Callable[[], asyncio.Protocol] = server
    if settings.listen.front == "native":
        factory = front = Front(built.dispatcher, server, limits, keepalive_s=KEEPALIVE_S)
    listener = await asyncio.get_running_loop().create_server(
        factory, host, port, reuse_port=reuse, backlog=settings.listen.backlog
    )
    built.guard.admin_writes_open = loopback_only(listener)
    bound = listener.sockets[0].getsockname()[1]
    running = Running(built, f"http://{host}:{bound}", None, listener, server, [runner], front)
    built.health.connections.add(
        "client", lambda: len(server.connections) + (len(front.connections) if front is not None else 0)
    )
    if built.metrics_app is not None and settings.listen.metrics_port is not None:
        metrics_runner = web.AppRunner(built.metrics_app, access_log=None)
        await metrics_runner.setup()
        await web.TCPSite(metrics_runner, host, settings.listen.metrics_port, reuse_port=reuse).start()
        running.metrics_url = f"http://{host}:{metrics_runner.addresses[0][1]}/metrics"
        running.runners.append(metrics_runner)
    picker = settings.endpoint_picker
    if picker is not None:
        generations = built.generations
        running.picker = PickerServer(built.picking, lambda: bool(generations.current.pool.healthy_names()),
                                      max_body_bytes=limits.max_body_bytes)
        running.picker_port = await running.picker.start(picker.listen.host, picker.listen.port, reuse_port=reuse_port)
    return running
