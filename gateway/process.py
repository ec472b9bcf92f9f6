"""Running the gateway: one worker process, or a supervisor of N workers sharing a port.

With `--workers N` the supervisor starts N `gateway serve` processes that bind the same port with
SO_REUSEPORT, so the kernel spreads connections over them and each runs its own event loop on its own
core. Routing stays consistent across workers because every policy is a pure function of shared
config and engine-reported state (prefix placement uses rendezvous hashing, not shared memory).
Each worker keeps its own metrics: scrape them per worker, or run one worker per host port.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
import tempfile
from pathlib import Path

import yaml

from . import build_check
from .app import Running, start
from .settings import Settings
from .state.reload import Reloader, ReloadRejected

log = logging.getLogger(__name__)


class _Signals:
    """SIGINT/SIGTERM stop; SIGHUP reloads the config (once a reloader is attached). Installed before
    the gateway says it is listening, so no signal can arrive to the default handlers."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.reloader: Reloader | None = None
        self.workers: list[asyncio.subprocess.Process] = []  # a supervisor forwards SIGHUP to these
        self._tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)

    def _on_hup(self) -> None:
        for proc in self.workers:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGHUP)
        if self.workers:
            return
        task = asyncio.create_task(self._reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload(self) -> None:
        if self.reloader is None:
            log.warning("SIGHUP: nothing to reload")
            return
        try:
            done = await self.reloader.reload()
            log.info("SIGHUP: reloaded, generation %d", done.generation)
        except ReloadRejected as exc:
            log.error("SIGHUP: new config rejected, the old one keeps serving: %s", "; ".join(exc.errors))


async def serve(
    settings: Settings | None, *, host: str | None, port: int | None, workers: int = 1, reuse_port: bool = False,
    config_path: str | None = None,
) -> int:
    demo = None
    if settings is None:
        from .demo import start_demo

        demo = await start_demo(host=host or "127.0.0.1")
        settings = demo.settings
    host = host or settings.listen.host
    port = settings.listen.port if port is None else port
    signals = _Signals()
    try:
        if workers > 1:
            url = await _supervise(settings, host=host, port=port, workers=workers, config_path=config_path,
                                   signals=signals)
        else:
            worker = await _start_worker(
                settings, host=host, port=port, reuse_port=reuse_port, config_path=config_path
            )
            url = worker.url
        if demo is not None:
            print(demo.banner(url), flush=True)
        if workers > 1:
            return 0
        signals.reloader = worker.built.reloader
        await signals.stop.wait()
        log.info("shutting down: draining in-flight requests for up to %.0f s", settings.limits.drain_timeout_s)
        await worker.stop(settings.limits.drain_timeout_s)
        return 0
    finally:
        if demo is not None:
            await demo.stop()


def _tune_gc() -> None:
    """Collect young objects less often, and never rescan what start-up built.

    With 700 (CPython's default) a young collection ran every two or three requests and walked
    every object of every in-flight request (thousands under load): ~10 % of the CPU per request.
    Request objects die by reference counting; the collector is only for the rare cycle, so running
    it every 20,000 allocations loses nothing. `gc.freeze()` moves start-up's objects (modules,
    config, the app) out of the collector's sight for good."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 10)


async def _start_worker(
    settings: Settings, *, host: str, port: int, reuse_port: bool, config_path: str | None = None
) -> Running:
    running = await start(settings, host=host, port=port, reuse_port=reuse_port, config_path=config_path)
    _tune_gc()
    log.info("build: %s", build_check.describe())
    print(f"gateway listening on {running.url}", flush=True)
    if running.metrics_url is not None:
        print(f"metrics on {running.metrics_url}", flush=True)
    return running


async def _supervise(
    settings: Settings, *, host: str, port: int, workers: int, config_path: str | None, signals: _Signals
) -> str:
    """Start `workers` worker processes on one port; return once they all listen, after printing the
    URL, then keep supervising until a signal arrives."""
    holder = None
    if port == 0:  # reserve a concrete port that every worker can then bind with SO_REUSEPORT
        holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((host, 0))
        port = holder.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="gateway-") as tmp:
        config = Path(tmp) / "gateway.yaml"
        if config_path is not None:  # the workers reload (SIGHUP, /admin/reload) from the real file
            config = Path(config_path)
        else:
            config.write_text(yaml.safe_dump(settings.model_dump(mode="json")))
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "serve", "--config", str(config), "--host", host,
                "--port", str(port), "--reuse-port", stdout=asyncio.subprocess.PIPE,
            )
            for _ in range(workers)
        ]
        signals.workers = procs
        try:
            for proc in procs:
                assert proc.stdout is not None
                line = (await proc.stdout.readline()).decode()
                if not line.startswith("gateway listening on "):
                    raise RuntimeError(f"a worker failed to start: {line!r}")
            if holder is not None:
                holder.close()
            url = f"http://{host}:{port}"
            print(f"gateway listening on {url} ({workers} workers)", flush=True)
            await signals.stop.wait()
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
            for proc in procs:
                await proc.wait()
    return url
