"""Composition root of one emulator: builds the engine, cache, driver, fault gate, metrics and the
runtime's face, and serves it on a real socket (`port=0` picks a free port)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from backends.base import Runtime
from backends.emulator.config import EmulatorConfig, EmulatorStats
from backends.emulator.context import FaceContext, StatsObserver
from backends.emulator.driver import EngineDriver, StepObserver
from backends.emulator.engine import Engine, Snapshot
from backends.emulator.faults import FaultGate
from backends.emulator.prefix_cache import BlockHashCache, NoCache, PrefixCache, RadixCache
from backends.emulator.profiles import CacheKind, EngineParams, get_profile


def make_cache(params: EngineParams, *, enabled: bool) -> PrefixCache:
    if not enabled or params.cache_kind is CacheKind.NONE:
        return NoCache()
    if params.cache_kind is CacheKind.RADIX:
        return RadixCache()
    return BlockHashCache(params.block_size)


@dataclass(frozen=True, slots=True)
class _Faces:
    app: web.Application
    metrics_app: web.Application | None
    observer: StepObserver


def _build_face(runtime: Runtime, ctx: FaceContext) -> _Faces:
    # Imported here so each face module stays independent of the others.
    if runtime is Runtime.VLLM:
        from backends.emulator import vllm_face
        from backends.emulator.vllm_metrics import VllmMetrics

        vm = VllmMetrics(ctx.model, ctx.params, max_model_len=ctx.config.max_model_len,
                         prefix_caching=not isinstance(ctx.driver.engine.cache, NoCache))
        return _Faces(vllm_face.build_app(ctx, vm), None, vm)
    if runtime is Runtime.SGLANG:
        from backends.emulator import sglang_face
        from backends.emulator.sglang_metrics import SglangMetrics

        sm = SglangMetrics(ctx.model, ctx.params, context_len=ctx.config.max_model_len)
        return _Faces(sglang_face.build_app(ctx, sm), None, sm)
    if runtime is Runtime.TRTLLM:
        from backends.emulator import trtllm_face
        from backends.emulator.trtllm_metrics import TrtllmMetrics

        tm = TrtllmMetrics(ctx.params)
        return _Faces(trtllm_face.build_app(ctx, tm), None, tm)
    from backends.emulator import triton_face
    from backends.emulator.triton_metrics import TritonMetrics

    xm = TritonMetrics(ctx.params)
    app, metrics_app = triton_face.build_apps(ctx, xm)
    return _Faces(app, metrics_app, xm)


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

    async def stop(self) -> None:
        for r in self._runners:
            await r.cleanup()
        await self.ctx.driver.stop()


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
    engine = Engine(params, make_cache(params, enabled=reuse))
    driver = EngineDriver(engine, speed=config.speed, clock=loop_clock)
    gate = FaultGate(config.faults, seed=config.seed, clock=loop_clock)
    return FaceContext(config, profile, params, driver, gate, EmulatorStats())


async def start_emulator(
    config: EmulatorConfig, *, host: str = "127.0.0.1", port: int = 0, metrics_port: int = 0
) -> RunningEmulator:
    """Start one emulator. For Triton the metrics are served on their own port (`metrics_port`)."""
    ctx = build_context(config)
    faces = _build_face(config.runtime, ctx)
    ctx.driver.observers.extend([StatsObserver(ctx.stats, ctx.changed), faces.observer])
    faces.observer.on_idle(ctx.snapshot())
    ctx.driver.start()
    runners: list[web.AppRunner] = []
    try:
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
        await ctx.driver.stop()
        raise
    return RunningEmulator(config, ctx, runners, url, metrics_url)
