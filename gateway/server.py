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
import logging
import signal
import socket
import sys
import tempfile
from pathlib import Path

import yaml
from aiohttp import web

from .app import build_app
from .settings import Settings

log = logging.getLogger("gateway.server")


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve(
    settings: Settings | None, *, host: str | None, port: int | None, workers: int = 1, reuse_port: bool = False
) -> int:
    demo = None
    if settings is None:
        from .demo import start_demo

        demo = await start_demo(host=host or "127.0.0.1")
        settings = demo.settings
    host = host or settings.listen.host
    port = settings.listen.port if port is None else port
    try:
        if workers > 1:
            url = await _supervise(settings, host=host, port=port, workers=workers)
        else:
            url, runner = await _start_worker(settings, host=host, port=port, reuse_port=reuse_port)
        if demo is not None:
            print(demo.banner(url), flush=True)
        if workers > 1:
            return 0
        await _wait_for_signal()
        log.info("shutting down")
        await runner.cleanup()
        return 0
    finally:
        if demo is not None:
            await demo.stop()


async def _start_worker(settings: Settings, *, host: str, port: int, reuse_port: bool) -> tuple[str, web.AppRunner]:
    app = await build_app(settings)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    url = f"http://{host}:{bound}"
    print(f"gateway listening on {url}", flush=True)
    return url, runner


async def _supervise(settings: Settings, *, host: str, port: int, workers: int) -> str:
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
        config.write_text(yaml.safe_dump(settings.model_dump(mode="json")))
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "serve", "--config", str(config), "--host", host,
                "--port", str(port), "--reuse-port", stdout=asyncio.subprocess.PIPE,
            )
            for _ in range(workers)
        ]
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
            await _wait_for_signal()
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
            for proc in procs:
                await proc.wait()
    return url
