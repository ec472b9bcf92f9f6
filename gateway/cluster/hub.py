"""The supervisor's side: what the workers of one host share, and the one place each thing happens.

SO_REUSEPORT spreads connections over the workers, so any request, scrape or admin call may land on
any of them. Whatever must describe or change the whole gateway goes through the hub, over each
worker's private channel (`channel`, on a Unix socket in a 0700 directory):

- **one committed generation**: the hub holds the config every worker runs (`committed`: its text,
  resolved secrets, number); a worker that (re)starts builds from it, sent over its channel, and a
  reload is two-phase, prepared by every worker before anything commits (`commit`);
- **one prober**: the hub probes the committed generation's backends, one task each, and sends
  every worker each result as it comes (`probes`, `state.health_feed`); workers probe only what
  their own discovery found;
- **one set of rate-limit buckets**: workers hold leases on them, settled in the background, never
  asked on a request (`hub_limits`; with a store, the fleet's buckets in Redis come first,
  `access.shared_limits`);
- **admin writes before the reply**: a weight change or a reload, wherever it arrived (or SIGHUP to
  the supervisor), is applied by every worker (a reload: committed by every one, or by none)
  before the hub answers; weights changed at run time
  are remembered and given to a worker that (re)starts, and with a store they are shared with every
  replica (`overrides`);
- **one /metrics**: a scrape that lands on any worker is answered with every worker's families
  merged by the rules they declare (`scrape`), monotonic while workers restart; the hub's own
  families (`gateway_worker_restarts_total`, `gateway_workers`) join them (`host_views`);
- **one comparison**: `/admin/compare` merges every worker's windows (`stats.export`), so counts,
  throughput and cost per 1M tokens are the whole gateway's, a retired worker's included until
  they age out (`host_views`, `windows`); with a store, the hub publishes them for the fleet view
  (`fleet`);
- **one listener for KV events only one process may hear** (a bound endpoint, trtllm-serve's
  draining `/kv_cache_events`): the hub receives and republishes them to every worker
  (`kvcache.relay`); workers connect to engines' own publishers themselves.

SGLang's router runs as one process; Envoy runs one process with a thread per core and shares its
stats and limits in memory. Here the workers are processes, so the supervisor plays that role.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from ..errors import WeightsConflict
from ..kvcache.intake import backend_headers
from ..kvcache.relay import KvRelay
from ..merge_rules import Merge, declare
from ..settings import Settings
from ..state.pool import Pool
from ..state.reload import Reloaded, ReloadRejected, restart_required
from ..state.store import Store
from ..tasks import cancel_all
from . import commit
from .channel import Channel, Handler
from .clock import gateway_clock
from .committed import Committed
from .fleet import FleetStats
from .host_views import BASELINE_S, HostViews
from .hub_limits import HostLimits
from .overrides import SharedWeights, configured_weights, fingerprints
from .probes import SharedProbes

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
PoolBuilder = Callable[[Settings], Pool]


@dataclass(eq=False)
class WorkerConn:
    """A live worker, as the hub knows it."""

    slot: int
    pid: int
    channel: Channel
    connected_at: float
    ready: bool = False  # built and serving (it asked for the hub's state): it takes part in reloads
    source: str = field(init=False)

    def __post_init__(self) -> None:
        self.source = f"worker-{self.slot}-pid-{self.pid}"


def replica_name(settings: Settings) -> str:
    if settings.state is not None and settings.state.replica_id:
        return settings.state.replica_id
    return f"{os.uname().nodename}-{os.getpid()}"


class Hub:
    def __init__(
        self, committed: Committed, *, config_path: str | None, build_pool: PoolBuilder,
        clock: Callable[[], float] = gateway_clock,
    ) -> None:
        self.committed = committed
        settings = self.settings = committed.settings
        self._config_path = config_path
        self._build_pool = build_pool
        self._clock = clock
        self.registry = CollectorRegistry()
        self.restarts = Counter("gateway_worker_restarts", "Workers the supervisor restarted after they exited.",
                                registry=self.registry)
        self.start_failures = Counter("gateway_worker_start_failures",
                                      "Worker starts that failed (the slot stays down and is retried).",
                                      registry=self.registry)
        self.slots_down: Callable[[], list[dict[str, Any]]] = list  # the supervisor's slots without a worker
        self.registry.register(_WorkersGauge(self))
        self.limits = HostLimits(clock)
        self.workers: dict[int, WorkerConn] = {}
        self.expected_workers = 0
        self.overrides: dict[str, tuple[str, dict[str, float]]] = {}  # model -> (split fingerprint, weights)
        self.replica = replica_name(settings)
        self.views = HostViews(each=self._each, current=lambda c: self.workers.get(c.slot) is c,
                               registry=self.registry, clock=clock, replica=self.replica)
        self.store: Store | None = None
        self.shared: SharedWeights | None = None
        self.fleet: FleetStats | None = None
        if settings.state is not None:
            self.store = Store(settings.state, registry=self.registry)
            self.shared = SharedWeights(
                self.store, replica=self.replica, apply=self._apply_shared,
                fingerprints=lambda: fingerprints(self.settings), interval_s=settings.state.sync_interval_s,
            )
            self.fleet = self.views.fleet = FleetStats(
                self.store, replica=self.replica, export=self.views.host_export,
                interval_s=settings.state.publish_interval_s, workers=lambda: len(self.workers))
        self._session: aiohttp.ClientSession | None = None
        self.probes: SharedProbes | None = None
        self.kv_relay: KvRelay | None = None
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._reload_lock = asyncio.Lock()
        self.restart_count = 0

    @property
    def generation(self) -> int:
        return self.committed.number

    def restarted(self) -> None:
        """The supervisor restarted a worker."""
        self.restarts.inc()
        self.restart_count += 1

    # -- lifetime -----------------------------------------------------------------------------------

    async def start(self, socket_path: Path) -> None:
        """Listen for workers on `socket_path`, probe once (workers start with real health), read the
        shared weights, then keep probing, sharing and scraping in the background."""
        session = self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        self.probes = SharedProbes(session, interval_s=self.settings.health.interval_s, clock=self._clock,
                                   make_states=lambda s: list(self._build_pool(s)), forward=self._forward_probes)
        self._server = await asyncio.start_unix_server(self._connected, path=str(socket_path))
        self.kv_relay = KvRelay(socket_path.parent, self._session)  # before the workers subscribe
        self._relay_kv_events(self.committed)
        await self.probes.adopt(self.settings, self.committed.epochs)
        if self.store is not None:
            await self.store.start()
            assert self.shared is not None
            assert self.fleet is not None
            await self.shared.start()
            await self.fleet.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._baseline_scrapes(), name="hub-scrapes")]

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        if self.probes is not None:
            await self.probes.close()
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

    def _relay_kv_events(self, committed: Committed) -> None:
        """The KV events only one process may hear, heard here for every worker (`kvcache.relay`)."""
        if self.kv_relay is not None:
            self.kv_relay.reconcile(committed.settings.backends, backend_headers(committed.secrets.backend_keys))

    def _forward_probes(self, found: list[list[Any]]) -> None:
        """Each probe result, to every worker, as it comes."""
        for conn in self.workers.values():
            conn.channel.notify("probes", found)

    async def _baseline_scrapes(self) -> None:
        while True:
            await asyncio.sleep(BASELINE_S)
            await self.views.refresh()

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

        def state(_: Any) -> dict[str, Any]:
            if conn is not None:
                conn.ready = True  # attached: from now on it prepares and commits reloads
            return self._state()

        handlers: dict[str, Handler] = {
            "hello": hello, "state": state, "settle": self.limits.settle,
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
        self.views.retire(conn)
        if self.workers.get(conn.slot) is conn:
            del self.workers[conn.slot]

    def _state(self) -> dict[str, Any]:
        """What a (re)starting worker adopts: the committed generation, the latest probe results and
        the weights set at run time."""
        return {"committed": self.committed.wire(), "probes": [] if self.probes is None else self.probes.snapshot(),
                "overrides": {m: w for m, (_, w) in self.overrides.items()}, "generation": self.generation}

    def _ready(self) -> list[WorkerConn]:
        """The workers that are built and serving. One still building has nothing to answer with (its
        handlers are attached last) and may be too busy to say so until a call's timeout; it adopts
        the hub's state as it is when it attaches (`state`), so no change made meanwhile is lost."""
        return [c for c in self.workers.values() if c.ready]

    async def _each(self, method: str, body: Any = None, *,
                    timeout_s: float = CALL_TIMEOUT_S) -> list[tuple[WorkerConn, Any]]:
        """Ask every ready worker at once; a worker that fails or is gone answers its exception."""
        conns = self._ready()
        answers = await asyncio.gather(*(c.channel.call(method, body, timeout_s=timeout_s) for c in conns),
                                       return_exceptions=True)
        return [(c, a) for c, a in zip(conns, answers, strict=True)]

    # -- metrics ------------------------------------------------------------------------------------

    async def metrics(self, accept: str) -> tuple[bytes, str]:
        """The whole gateway's /metrics (`host_views`)."""
        return await self.views.metrics(accept)

    async def _metrics(self, body: dict[str, Any]) -> list[str]:
        page, content_type = await self.metrics(str(body.get("accept", "")))
        return [page.decode(), content_type]

    # -- comparison ---------------------------------------------------------------------------------

    async def compare(self, window: int, scope: str) -> dict[str, Any]:
        """The whole gateway's comparison (`host_views`)."""
        return await self.views.compare(window, scope)

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
        """Re-read the config file and reload it in two phases (`commit`): every serving worker
        prepares it, then every one commits it; if any refuses, every one aborts it and nothing here
        changed (the committed generation, the probes, the weights)."""
        async with self._reload_lock:
            if self._config_path is None:
                raise ReloadRejected(["<config>: started without --config (demo fleet): nothing to reload"])
            current = self.committed
            proposal = await commit.reload(current, self._config_path, self._commit,
                                           self._ready)
            restart = restart_required(current.settings, proposal.settings)
            log.info("config reloaded on %d workers: generation %d%s", len(self.workers), proposal.number,
                     f" (restart required for {', '.join(restart)})" if restart else "")
            return Reloaded(proposal.number, restart)

    async def _commit(self, proposal: Committed) -> None:
        """The hub's own commit: the generation, the weights it keeps, its probes, the KV relays."""
        before, after = fingerprints(self.settings), fingerprints(proposal.settings)
        changed = {m for m in before if after.get(m) != before[m]}
        for model in changed:
            self.overrides.pop(model, None)
        if self.shared is not None:
            self.shared.forget(changed)
        self.committed, self.settings = proposal, proposal.settings
        if self.probes is not None:
            await self.probes.adopt(proposal.settings, proposal.epochs)  # new backends' first results
        self._relay_kv_events(proposal)  # before the workers commit: theirs subscribe to it

    async def _reload_call(self, body: Any) -> dict[str, Any]:
        try:
            done = await self.reload()
        except ReloadRejected as exc:
            return {"errors": exc.errors}
        return {"generation": done.generation, "restart_required": done.restart_required}

    # -- the workers, for operators -----------------------------------------------------------------

    async def workers_doc(self) -> dict[str, Any]:
        building = [c for c in self.workers.values() if not c.ready]  # listed, not asked: no generation yet
        rows = []
        for conn, answer in [*await self._each("identity", timeout_s=5.0), *((c, None) for c in building)]:
            row: dict[str, Any] = {"worker": conn.slot, "pid": conn.pid, "ready": conn.ready,
                                   "up_s": self._clock() - conn.connected_at}
            if isinstance(answer, dict):
                row.update(answer)
            elif answer is not None:  # a built worker that did not answer in time (its loop stalled, or it is gone)
                row["error"] = f"{type(answer).__name__}: {answer}"
            rows.append(row)
        return {"workers": sorted(rows, key=lambda r: int(r["worker"])), "expected": self.expected_workers,
                "down": self.slots_down(), "restarts": self.restart_count, "generation": self.generation,
                "replica": self.replica, "state_store_up": None if self.store is None else self.store.up}

    async def _workers_doc(self, body: Any) -> dict[str, Any]:
        return await self.workers_doc()


declare(Merge.SUM, "gateway_worker_restarts_total", "gateway_worker_start_failures_total")  # the hub's own
declare(Merge.MAX, "gateway_workers", "gateway_worker_slots_down")  # families: one source each


class _WorkersGauge:
    def __init__(self, hub: Hub) -> None:
        self._hub = hub

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        family = GaugeMetricFamily("gateway_workers", "Worker processes serving (connected to their supervisor).")
        family.add_metric([], float(len(self._hub.workers)))
        yield family
        down = GaugeMetricFamily("gateway_worker_slots_down",
                                 "Worker slots without a running worker (exited, or failing to start: retried).")
        down.add_metric([], float(len(self._hub.slots_down())))
        yield down
