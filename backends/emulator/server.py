"""Composition root of one emulator: builds the engine, cache, driver, fault gate, metrics and the
runtime's face, and serves it on a real socket (`port=0` picks a free port)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from backends.base import Runtime
from backends.emulator.block_hashes import python_hashes, trtllm_hashes, vllm_hashes
from backends.emulator.config import EmulatorConfig, EmulatorStats
from backends.emulator.context import FaceContext, KvEventsObserver, StatsObserver
from backends.emulator.dp import RankEngine, offset_endpoint
from backends.emulator.driver import EngineDriver, StepObserver
from backends.emulator.engine import Engine, Snapshot
from backends.emulator.faults import FaultGate
from backends.emulator.kv_events import EventCollector, KvEventSink, KvPublisher
from backends.emulator.kv_handoff import KvHandoff
from backends.emulator.kv_zmq import ZmqKvPublisher
from backends.emulator.prefix_cache import BlockHashCache, NoCache, PrefixCache, RadixCache
from backends.emulator.profiles import CacheKind, EngineParams, get_profile
from backends.emulator.shared_storage import SharedStorage
from backends.emulator.trtllm_kv_events import TrtllmKvEventQueue


def make_cache(
    params: EngineParams, *, enabled: bool, runtime: Runtime | None = None, sink: KvEventSink | None = None
) -> PrefixCache:
    """The runtime's prefix cache; with a `sink` it reports stores and evictions with the runtime's
    own block hashes (without one, a cheap Python hash keys the blocks)."""
    if not enabled or params.cache_kind is CacheKind.NONE:
        return NoCache()
    if params.cache_kind is CacheKind.RADIX:
        return RadixCache(params.block_size, sink=sink)
    hasher = python_hashes
    if sink is not None:
        hasher = trtllm_hashes if runtime is Runtime.TRTLLM else vllm_hashes
    return BlockHashCache(params.block_size, hasher=hasher, sink=sink)


def _with_overrides(params: EngineParams, config: EmulatorConfig) -> EngineParams:
    """`block_size` keeps the pool's token capacity unless `num_kv_blocks` sets the block count."""
    if config.block_size is not None and config.block_size != params.block_size:
        tokens = params.kv_blocks * params.block_size
        params = dataclasses.replace(params, block_size=config.block_size, kv_blocks=tokens // config.block_size)
    if config.num_kv_blocks is not None:
        params = dataclasses.replace(params, kv_blocks=config.num_kv_blocks)
    return params


@dataclass(frozen=True, slots=True)
class _Faces:
    app: web.Application
    metrics_app: web.Application | None
    observers: list[StepObserver]  # the metrics observer of each data-parallel rank's engine


def _build_face(runtime: Runtime, ctx: FaceContext) -> _Faces:
    # Imported here so each face module stays independent of the others.
    size = ctx.data_parallel_size
    if runtime is Runtime.VLLM:
        from backends.emulator import vllm_face
        from backends.emulator.vllm_metrics import VllmMetrics

        vm = VllmMetrics(ctx.model, ctx.params, max_model_len=ctx.config.max_model_len,
                         prefix_caching=not isinstance(ctx.driver.engine.cache, NoCache), engines=size)
        return _Faces(vllm_face.build_app(ctx, vm), None, [vm.engine(r) for r in range(size)])
    if runtime is Runtime.SGLANG:
        from backends.emulator import sglang_face
        from backends.emulator.sglang_metrics import SglangMetrics

        sm = SglangMetrics(ctx.model, ctx.params, context_len=ctx.config.max_model_len, dp_size=size)
        return _Faces(sglang_face.build_app(ctx, sm), None, [sm.rank(r) for r in range(size)])
    if runtime is Runtime.TRTLLM:
        from backends.emulator import trtllm_face
        from backends.emulator.trtllm_metrics import TrtllmMetrics

        tm = TrtllmMetrics(ctx.params)
        return _Faces(trtllm_face.build_app(ctx, tm), None, [tm])
    from backends.emulator import triton_face
    from backends.emulator.triton_metrics import TritonMetrics

    xm = TritonMetrics(ctx.params)
    app, metrics_app = triton_face.build_apps(ctx, xm)
    return _Faces(app, metrics_app, [xm])


class RunningEmulator:
    """A started emulator. `stats` are live counters; `stop()` closes the sockets and the engine loop."""

    def __init__(
        self, config: EmulatorConfig, ctx: FaceContext, runners: list[web.AppRunner], url: str, metrics_url: str
    ) -> None:
        self.config = config
        self.name = config.runtime.value
        self.ctx = ctx
        self._runners = runners
        self.url = url
        self.metrics_url = metrics_url

    @property
    def runtime(self) -> Runtime:
        return self.config.runtime

    @property
    def stats(self) -> EmulatorStats:
        return self.ctx.stats

    @property
    def usd_per_hour(self) -> float:
        return self.ctx.profile.usd_per_hour

    @property
    def aborted(self) -> int:
        return self.ctx.stats.aborted

    def snapshot(self) -> Snapshot:
        """The engine's live state (running, waiting, KV blocks, uncached backlog), for tests and demos."""
        return self.ctx.snapshot()

    async def wait_until(self, predicate: Callable[[EmulatorStats], bool], *, timeout_s: float = 10.0) -> None:
        """Wait until `predicate(stats)` holds (for tests); re-checked on every engine event and at
        least every 10 ms. Raises TimeoutError after `timeout_s` wall seconds."""
        async with asyncio.timeout(timeout_s):
            while not predicate(self.stats):
                self.ctx.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.ctx.changed.wait(), 0.01)

    @property
    def kv_events(self) -> KvPublisher | None:
        """The KV-event publisher (test knobs: `drop_next()`, `silence()`), None when not configured."""
        return self.ctx.kv_publisher

    @property
    def side_channel_ports(self) -> list[int]:
        """Each rank's KV side channel port (vLLM NIXL, trtllm); empty without one."""
        return [h.port for h in self.ctx.handoffs]

    @property
    def bootstrap_port(self) -> int | None:
        """SGLang prefill: the bootstrap server's bound port."""
        return self.ctx.bootstrap_port

    def disagg_summary(self) -> str:
        """The P/D endpoints for the CLI's ready line."""
        parts = []
        if self.side_channel_ports:
            parts.append(" side_channel=" + ",".join(map(str, self.side_channel_ports)))
        if self.bootstrap_port is not None:
            parts.append(f" bootstrap_port={self.bootstrap_port}")
        return "".join(parts)

    def served_by_rank(self) -> list[int]:
        """Engine requests each data-parallel rank was given (one entry without data parallelism)."""
        return [r.requests for r in self.ctx.ranks]

    async def stop(self) -> None:
        for r in self._runners:
            await r.cleanup()
        await _stop_ranks(self.ctx)


async def _stop_ranks(ctx: FaceContext) -> None:
    for rank in ctx.ranks:
        await rank.driver.stop()
        if isinstance(rank.kv_publisher, ZmqKvPublisher):
            await rank.kv_publisher.close()
    for handoff in ctx.handoffs:
        await handoff.close()
    await _stop_disagg_extras(ctx)
    ctx.close_zmq()


async def _stop_disagg_extras(ctx: FaceContext) -> None:
    for stop in ctx.on_stop:
        await stop()
    ctx.on_stop.clear()


SHUTDOWN_GRACE_S = 0.25


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def _serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    # A stopped emulator is a dead backend: in-flight requests are cut after a short grace period
    # instead of aiohttp's default 60 s graceful wait (hung requests would otherwise block `stop()`).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    sock = _bind(host, port)
    site = web.SockSite(runner, sock)
    await site.start()
    return runner, int(sock.getsockname()[1])


def build_context(config: EmulatorConfig, *, clock: Callable[[], float] | None = None) -> FaceContext:
    loop_clock = clock or asyncio.get_running_loop().time
    profile = get_profile(config.profile)
    params = profile.runtimes[config.runtime]
    reuse = config.prefix_reuse if config.prefix_reuse is not None else params.cache_kind is not CacheKind.NONE
    if config.prefix_reuse and params.cache_kind is CacheKind.NONE:
        params = dataclasses.replace(params, cache_kind=CacheKind.BLOCK_HASH)
    params = _with_overrides(params, config)
    if config.kv_events is not None and config.runtime is Runtime.TRITON:
        raise ValueError("the Triton face publishes no KV-cache events (its TensorRT-LLM backend has no publisher)")
    if config.data_parallel_size < 1 or (config.data_parallel_size > 1 and config.runtime not in _DP_RUNTIMES):
        raise ValueError("--data-parallel-size: vLLM and SGLang only (trtllm-serve and Triton take no rank)")
    gate = FaultGate(config.faults, seed=config.seed, clock=loop_clock)
    ranks = []
    for r in range(config.data_parallel_size):
        collector = EventCollector() if config.kv_events is not None else None
        engine = Engine(params, make_cache(params, enabled=reuse, runtime=config.runtime, sink=collector))
        ranks.append(RankEngine(r, EngineDriver(engine, speed=config.speed, clock=loop_clock), collector))
    ctx = FaceContext(config, profile, params, ranks[0].driver, gate, EmulatorStats())
    ctx.ranks = ranks
    ctx.kv_collector = ranks[0].kv_collector
    _check_disagg(config)
    pd = config.disagg
    if pd is not None and config.runtime is Runtime.VLLM and pd.connector != "NixlConnector":
        assert pd.shared_storage_path is not None
        ctx.shared_storage = SharedStorage(pd.shared_storage_path, params.block_size)
    return ctx


def _check_disagg(config: EmulatorConfig) -> None:
    pd = config.disagg
    if pd is None:
        return
    if config.runtime is Runtime.TRITON:
        raise ValueError("--role: vLLM, SGLang and trtllm-serve only (Triton's TensorRT-LLM backend is aggregated)")
    if pd.role not in ("prefill", "decode", "both"):
        raise ValueError(f"--role must be prefill, decode or both, not {pd.role!r}")
    if config.runtime is Runtime.VLLM:
        from backends.emulator.vllm_pd import CONNECTORS, NIXL

        if pd.connector not in CONNECTORS:
            raise ValueError(f"kv_connector {pd.connector!r}: the emulator has {', '.join(sorted(CONNECTORS))}")
        if pd.connector != NIXL and not pd.shared_storage_path:
            raise ValueError(f"{pd.connector} needs kv_connector_extra_config.shared_storage_path")


async def _start_sglang_pd(ctx: FaceContext, host: str) -> None:
    """SGLang in prefill or decode mode: each rank's KV manager; a prefill's bootstrap server,
    with every rank registered (as its KV managers do at start)."""
    pd = ctx.config.disagg
    if pd is None or pd.role == "both" or ctx.config.runtime is not Runtime.SGLANG:
        return
    from backends.emulator.sglang_bootstrap import BootstrapStore, build_app
    from backends.emulator.sglang_kv import KvManager

    ctx.sglang_kv = [KvManager(ctx.zmq_context(), host, r.rank) for r in ctx.ranks]
    for manager in ctx.sglang_kv:
        ctx.on_stop.append(manager.close)
    if pd.role != "prefill":
        return
    store = BootstrapStore()
    for manager in ctx.sglang_kv:
        store.register({"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
                        "attn_dp_size": len(ctx.ranks), "attn_dp_rank": manager.rank, "pp_size": 1, "pp_rank": 0,
                        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": manager.host,
                        "rank_port": manager.port, "page_size": ctx.params.block_size,
                        "kv_cache_dtype": "auto", "load_balance_method": "follow_bootstrap_room"})
    runner, bound = await _serve(build_app(store), host, pd.bootstrap_port or 0)
    ctx.bootstrap_port = bound
    ctx.on_stop.append(runner.cleanup)


async def _start_handoffs(ctx: FaceContext, host: str) -> None:
    """The NIXL side channel of each rank (vLLM NixlConnector; trtllm-serve's cache transceiver)."""
    pd = ctx.config.disagg
    if pd is None or ctx.config.runtime not in (Runtime.VLLM, Runtime.TRTLLM):
        return
    if ctx.config.runtime is Runtime.VLLM and pd.connector != "NixlConnector":
        return
    base_id = pd.engine_id or str(uuid.uuid4())
    side_host = pd.side_channel_host or host
    for rank in ctx.ranks:
        engine_id = base_id if len(ctx.ranks) == 1 else f"{base_id}_dp{rank.rank}"
        handoff = KvHandoff(rank.driver.engine, engine_id=engine_id, lease_s=pd.kv_lease_s, stats=ctx.stats,
                            on_change=rank.driver.refresh)
        handoff.bind(ctx.zmq_context(), side_host, pd.side_channel_port + rank.rank if pd.side_channel_port else 0)
        ctx.handoffs.append(handoff)


_DP_RUNTIMES = frozenset({Runtime.VLLM, Runtime.SGLANG})


def _kv_publisher(ctx: FaceContext, rank: int = 0) -> ZmqKvPublisher | TrtllmKvEventQueue | None:
    cfg = ctx.config.kv_events
    if cfg is None:
        return None
    if ctx.config.runtime is Runtime.TRTLLM:
        return TrtllmKvEventQueue(cfg, window_size=ctx.config.max_model_len, primary_blocks=ctx.params.kv_blocks)
    style = "sglang" if ctx.config.runtime is Runtime.SGLANG else f"vllm-{cfg.encoding}"
    if rank:  # each rank's publisher (and replay socket) on the endpoint's port + rank
        replay = None if cfg.replay_endpoint is None else offset_endpoint(cfg.replay_endpoint, rank)
        cfg = dataclasses.replace(cfg, endpoint=offset_endpoint(cfg.endpoint, rank), replay_endpoint=replay)
    return ZmqKvPublisher(cfg, style=style, replay_with_topic=ctx.config.runtime is Runtime.VLLM, dp_rank=rank)


async def start_emulator(
    config: EmulatorConfig, *, host: str = "127.0.0.1", port: int = 0, metrics_port: int = 0
) -> RunningEmulator:
    """Start one emulator. For Triton the metrics are served on their own port (`metrics_port`)."""
    ctx = build_context(config)
    for rank in ctx.ranks:
        rank.kv_publisher = _kv_publisher(ctx, rank.rank)
    ctx.kv_publisher = ctx.ranks[0].kv_publisher
    faces = _build_face(config.runtime, ctx)
    for rank, observer in zip(ctx.ranks, faces.observers, strict=True):
        rank.driver.observers.extend([StatsObserver(ctx.stats, ctx.changed), observer])
        if rank.kv_publisher is not None:
            rank.driver.observers.append(KvEventsObserver(ctx, rank.rank))
        observer.on_idle(rank.driver.engine.snapshot())
        rank.driver.start()
    runners: list[web.AppRunner] = []
    try:
        await _start_handoffs(ctx, host)
        await _start_sglang_pd(ctx, host)
        runner, bound = await _serve(faces.app, host, port)
        runners.append(runner)
        url = f"http://{host}:{bound}"
        metrics_url = url
        if faces.metrics_app is not None:
            mrunner, mbound = await _serve(faces.metrics_app, host, metrics_port)
            runners.append(mrunner)
            metrics_url = f"http://{host}:{mbound}"
    except BaseException:
        for r in runners:
            await r.cleanup()
        await _stop_ranks(ctx)
        raise
    return RunningEmulator(config, ctx, runners, url, metrics_url)
