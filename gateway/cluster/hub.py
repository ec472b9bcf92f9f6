"""The supervisor's side: what the workers of one host share, and the one place each thing happens.

SO_REUSEPORT spreads connections over the workers, so any request, scrape or admin call may land on
any of them. Whatever must describe or change the whole gateway goes through the hub, over each
worker's private channel (`channel`, on a Unix socket in a 0700 directory):

- **one probe loop**: the hub runs the only `HealthPoller` of the gateway and sends every worker
  each round's results (`state.health_feed`); workers probe nothing themselves;
- **one set of rate-limit buckets**: workers hold leases on them, settled in the background, never
  asked on a request (`hub_limits`; with a store, the fleet's buckets in Redis come first,
  `access.shared_limits`);
- **admin writes before the reply**: a weight change or a reload, wherever it arrived (or SIGHUP to
  the supervisor), is applied by every worker before the hub answers; weights changed at run time
  are remembered and given to a worker that (re)starts, and with a store they are shared with every
  replica (`overrides`);
- **one /metrics**: a scrape that lands on any worker is answered with every worker's families
  merged (`scrape`), monotonic while workers restart; the hub's own families
  (`gateway_worker_restarts_total`, `gateway_workers`) join them;
- **one comparison**: `/admin/compare` merges every worker's windows (`stats.export`), so counts,
  throughput and cost per 1M tokens are the whole gateway's; with a store, the hub publishes them
  for the fleet view (`fleet`);
- **one listener for KV events only one process may hear** (a bound endpoint, trtllm-serve's
  draining `/kv_cache_events`): the hub receives and republishes them to every worker
  (`kvcache.relay`); workers connect to engines' own publishers themselves.

SGLang's router runs as one process; Envoy runs one process with a thread per core and shares its
stats and limits in memory. Here the workers are processes, so the supervisor plays that role.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from ..access.secrets import resolve_secrets
from ..errors import WeightsConflict
from ..kvcache.intake import backend_headers
from ..kvcache.relay import KvRelay
from ..settings import ConfigError, Settings, load_settings
from ..state.health import HealthPoller
from ..state.health_feed import Result, results
from ..state.pool import Pool
from ..state.reload import Reloaded, ReloadRejected, restart_required
from ..state.store import Store, StoreDown
from ..stats import Comparer
from ..stats.export import Export, export_book, merge
from ..tasks import cancel_all
from .channel import Channel, Handler
from .clock import gateway_clock
from .fleet import FleetStats, replica_row
from .hub_limits import HostLimits
from .overrides import SharedWeights, configured_weights, fingerprints
from .scrape import ScrapeMerger, dump

log = logging.getLogger(__name__)

BASELINE_SCRAPE_S = 5.0  # besides every scrape: bounds what a crashed worker's counters lose
CALL_TIMEOUT_S = 10.0
PoolBuilder = Callable[[Settings], Pool]


@dataclass(eq=False)
class WorkerConn:
    """A live worker, as the hub knows it."""

    slot: int
    pid: int
    channel: Channel
    connected_at: float
    source: str = field(init=False)

    def __post_init__(self) -> None:
        self.source = f"worker-{self.slot}-pid-{self.pid}"


def replica_name(settings: Settings) -> str:
    if settings.state is not None and settings.state.replica_id:
        return settings.state.replica_id
    return f"{os.uname().nodename}-{os.getpid()}"


class Hub:
    def __init__(
        self, settings: Settings, *, config_path: str | None, build_pool: PoolBuilder,
        clock: Callable[[], float] = gateway_clock,
    ) -> None:
        self.settings = settings
        self._config_path = config_path
        self._build_pool = build_pool
        self._clock = clock
        self.registry = CollectorRegistry()
        self.restarts = Counter("gateway_worker_restarts", "Workers the supervisor restarted after they exited.",
                                registry=self.registry)
        self.registry.register(_WorkersGauge(self))
        self.merger = ScrapeMerger()
        self.limits = HostLimits(clock)
        self.workers: dict[int, WorkerConn] = {}
        self.expected_workers = 0
        self.generation = 1
        self.overrides: dict[str, tuple[str, dict[str, float]]] = {}  # model -> (split fingerprint, weights)
        self.probes: list[Result] = []
        self.replica = replica_name(settings)
        self.store: Store | None = None
        self.shared: SharedWeights | None = None
        self.fleet: FleetStats | None = None
        if settings.state is not None:
            self.store = Store(settings.state, registry=self.registry)
            self.shared = SharedWeights(
                self.store, replica=self.replica, apply=self._apply_shared,
                fingerprints=lambda: fingerprints(self.settings), interval_s=settings.state.sync_interval_s,
            )
            self.fleet = FleetStats(self.store, replica=self.replica, export=self._host_export,
                                    interval_s=settings.state.publish_interval_s, workers=lambda: len(self.workers))
        self._pool = build_pool(settings)
        self._session: aiohttp.ClientSession | None = None
        self._poller: HealthPoller | None = None
        self.kv_relay: KvRelay | None = None
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._reload_lock = asyncio.Lock()
        self._docs: dict[tuple[str, int, int], dict[str, Any]] = {}
        self._comparers: dict[str, Comparer] = {}
        self.restart_count = 0

    def restarted(self) -> None:
        """The supervisor restarted a worker."""
        self.restarts.inc()
        self.restart_count += 1

    # -- lifetime -----------------------------------------------------------------------------------

    async def start(self, socket_path: Path) -> None:
        """Listen for workers on `socket_path`, probe once (workers start with real health), read the
        shared weights, then keep probing, sharing and scraping in the background."""
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        self._poller = self._new_poller(self._pool)
        self._server = await asyncio.start_unix_server(self._connected, path=str(socket_path))
        self.kv_relay = KvRelay(socket_path.parent, self._session)  # before the workers subscribe
        self._relay_kv_events(self.settings)
        await self._poller.poll_once()
        self.probes = results(self._pool)
        if self.store is not None:
            await self.store.start()
            assert self.shared is not None
            assert self.fleet is not None
            await self.shared.start()
            await self.fleet.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._probe_loop(), name="hub-probes"),
                       loop.create_task(self._baseline_scrapes(), name="hub-scrapes")]

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        if self._server is not None:
            self._server.close()
        for conn in list(self.workers.values()):
            await conn.channel.close()
        for part in (self.shared, self.fleet, self.store):
            if part is not None:
                await part.close()
        if self.kv_relay is not None:
            await self.kv_relay.close()
        if self._session is not None:
            await self._session.close()

    def _relay_kv_events(self, settings: Settings) -> None:
        """The KV events only one process may hear, heard here for every worker (`kvcache.relay`)."""
        if self.kv_relay is None:
            return
        try:
            keys = resolve_secrets(settings, source=self._config_path or "<config>").backend_keys
        except ConfigError:  # (the workers refuse such a config themselves)
            keys = {}
        self.kv_relay.reconcile(settings.backends, backend_headers(keys))

    def _new_poller(self, pool: Pool) -> HealthPoller:
        assert self._session is not None
        return HealthPoller(pool, self._session, interval_s=self.settings.health.interval_s, clock=self._clock)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health.interval_s)
            poller, pool = self._poller, self._pool
            assert poller is not None
            await poller.poll_once()
            if pool is self._pool:  # (a reload swapped the pool meanwhile: its own round went out)
                self._broadcast_probes()

    def _broadcast_probes(self) -> None:
        self.probes = results(self._pool)
        for conn in self.workers.values():
            conn.channel.notify("probes", self.probes)

    async def _baseline_scrapes(self) -> None:
        while True:
            await asyncio.sleep(BASELINE_SCRAPE_S)
            await self._scrape_workers()

    # -- workers ------------------------------------------------------------------------------------

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn: WorkerConn | None = None
        channel = Channel(reader, writer, {}, name="hub<-worker")

        def hello(body: dict[str, Any]) -> dict[str, Any]:
            nonlocal conn
            conn = WorkerConn(int(body["slot"]), int(body["pid"]), channel, self._clock())
            old = self.workers.get(conn.slot)
            if old is not None:
                self._retire(old)
            self.workers[conn.slot] = conn
            return self._state()

        handlers: dict[str, Handler] = {
            "hello": hello, "state": lambda _: self._state(), "settle": self.limits.settle,
            "metrics": self._metrics, "compare": self._compare, "weights": self._weights, "reload": self._reload_call,
            "workers": self._workers_doc,
        }
        for name, handler in handlers.items():
            channel.handle(name, handler)
        try:
            await channel.run()
        finally:
            if conn is not None and self.workers.get(conn.slot) is conn:
                self._retire(conn)

    def _retire(self, conn: WorkerConn) -> None:
        self.merger.retire(conn.source)
        if self.workers.get(conn.slot) is conn:
            del self.workers[conn.slot]

    def _state(self) -> dict[str, Any]:
        """What a (re)starting worker adopts: the last probe round and the weights set at run time."""
        return {"probes": self.probes, "overrides": {m: w for m, (_, w) in self.overrides.items()},
                "generation": self.generation}

    async def _each(self, method: str, body: Any = None, *,
                    timeout_s: float = CALL_TIMEOUT_S) -> list[tuple[WorkerConn, Any]]:
        """Ask every live worker at once; a worker that fails or is gone answers its exception."""
        conns = list(self.workers.values())
        answers = await asyncio.gather(*(c.channel.call(method, body, timeout_s=timeout_s) for c in conns),
                                       return_exceptions=True)
        return [(c, a) for c, a in zip(conns, answers, strict=True)]

    # -- metrics ------------------------------------------------------------------------------------

    async def _scrape_workers(self) -> None:
        for conn, answer in await self._each("collect", timeout_s=5.0):
            if isinstance(answer, list) and self.workers.get(conn.slot) is conn:
                self.merger.update(conn.source, answer)
        self.merger.update("hub", dump(self.registry))

    async def metrics(self, accept: str) -> tuple[bytes, str]:
        """The whole gateway's /metrics (a worker that does not answer in time contributes what it
        reported last)."""
        await self._scrape_workers()
        return self.merger.render(accept)

    async def _metrics(self, body: dict[str, Any]) -> list[str]:
        page, content_type = await self.metrics(str(body.get("accept", "")))
        return [page.decode(), content_type]

    # -- comparison ---------------------------------------------------------------------------------

    async def _worker_exports(self, max_samples: int | None) -> list[Export]:
        return [a for _, a in await self._each("stats", {"max_samples": max_samples}, timeout_s=30.0)
                if isinstance(a, dict)]

    async def _host_export(self, max_samples: int | None) -> Export:
        now = self._clock()
        exports = await self._worker_exports(max_samples)
        return export_book(merge(exports, now=now), now, max_samples=max_samples)

    async def compare(self, window: int, scope: str) -> dict[str, Any]:
        now = self._clock()
        key = (scope, window, math.floor(now))
        doc = self._docs.get(key)
        if doc is not None:
            return {**doc, "now_s": now}
        exports = await self._worker_exports(None)
        extra: dict[str, Any] = {"scope": scope, "workers": len(exports)}
        if scope == "fleet":
            own = export_book(merge(exports, now=now), now)
            others: list[Export] = []
            if self.fleet is not None:
                with contextlib.suppress(StoreDown):
                    others = await self.fleet.others()
            wall = time.time()
            extra["replicas"] = [{"replica": self.replica, "workers": len(exports), "age_s": 0.0},
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

    async def _compare(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.compare(int(body["window"]), str(body.get("scope", "replica")))

    # -- admin writes -------------------------------------------------------------------------------

    async def set_weights(self, model: str, weights: dict[str, float]) -> dict[str, float]:
        """Share with the fleet (WeightsConflict if another replica wrote first: its weights are then
        in force on every worker), apply on every worker, remember for those that start later."""
        split = fingerprints(self.settings).get(model)
        if split is None:
            raise KeyError(model)
        if self.shared is not None:
            kept = self.overrides.get(model)
            previous = kept[1] if kept is not None else configured_weights(self.settings, model)
            await self.shared.put(model, weights, previous=previous)
        self.overrides[model] = (split, dict(weights))
        failed = [f"worker {c.slot}: {a}" for c, a in await self._each("apply_weights", [model, weights])
                  if isinstance(a, BaseException)]
        if failed:
            log.error("weights for %s not applied everywhere: %s", model, "; ".join(failed))
        return dict(weights)

    async def _weights(self, body: list[Any]) -> dict[str, Any]:
        model, weights = body
        try:
            return {"weights": await self.set_weights(str(model), {str(k): float(v) for k, v in weights.items()})}
        except WeightsConflict as lost:
            return {"conflict": lost.record, "message": lost.message}

    async def _apply_shared(self, model: str, weights: dict[str, float]) -> None:
        """Another replica changed a split's weights (polled from the store)."""
        split = fingerprints(self.settings).get(model)
        if split is None:
            return
        self.overrides[model] = (split, dict(weights))
        await self._each("apply_weights", [model, weights])

    async def reload(self) -> Reloaded:
        """Re-read the config file; valid: every worker reloads before this returns."""
        async with self._reload_lock:
            if self._config_path is None:
                raise ReloadRejected(["<config>: started without --config (demo fleet): nothing to reload"])
            try:
                settings = load_settings(self._config_path)
                resolve_secrets(settings, source=self._config_path)
            except ConfigError as exc:
                log.warning("config reload rejected: %s", "; ".join(exc.errors))
                raise ReloadRejected(exc.errors) from None
            except OSError as exc:
                raise ReloadRejected([f"<file>: cannot read {self._config_path}: {type(exc).__name__}"]) from None
            old = self.settings
            before, after = fingerprints(old), fingerprints(settings)
            pool = self._build_pool(settings)
            self.settings = settings
            self._pool, self._poller = pool, self._new_poller(pool)
            await self._poller.poll_once()
            self.probes = results(pool)
            self._relay_kv_events(settings)  # before the workers reload: theirs subscribe to it
            changed = {m for m in before if after.get(m) != before[m]}
            for model in changed:
                self.overrides.pop(model, None)
            if self.shared is not None:
                self.shared.forget(changed)
            errors = []
            for conn, answer in await self._each("reload", timeout_s=60.0):
                if isinstance(answer, BaseException):
                    errors.append(f"worker {conn.slot}: {answer}")
                elif answer.get("errors"):
                    errors += [f"worker {conn.slot}: {e}" for e in answer["errors"]]
            self._broadcast_probes()
            if errors:
                raise ReloadRejected(errors)
            self.generation += 1
            restart = restart_required(old, settings)
            log.info("config reloaded on %d workers: generation %d%s", len(self.workers), self.generation,
                     f" (restart required for {', '.join(restart)})" if restart else "")
            return Reloaded(self.generation, restart)

    async def _reload_call(self, body: Any) -> dict[str, Any]:
        try:
            done = await self.reload()
        except ReloadRejected as exc:
            return {"errors": exc.errors}
        return {"generation": done.generation, "restart_required": done.restart_required}

    # -- the workers, for operators -----------------------------------------------------------------

    async def workers_doc(self) -> dict[str, Any]:
        rows = []
        for conn, answer in await self._each("identity", timeout_s=5.0):
            row = {"worker": conn.slot, "pid": conn.pid, "up_s": self._clock() - conn.connected_at}
            if isinstance(answer, dict):
                row.update(answer)
            rows.append(row)
        return {"workers": sorted(rows, key=lambda r: int(r["worker"])), "expected": self.expected_workers,
                "restarts": self.restart_count, "generation": self.generation,
                "replica": self.replica, "state_store_up": None if self.store is None else self.store.up}

    async def _workers_doc(self, body: Any) -> dict[str, Any]:
        return await self.workers_doc()


class _WorkersGauge:
    def __init__(self, hub: Hub) -> None:
        self._hub = hub

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        family = GaugeMetricFamily("gateway_workers", "Worker processes serving (connected to their supervisor).")
        family.add_metric([], float(len(self._hub.workers)))
        yield family
