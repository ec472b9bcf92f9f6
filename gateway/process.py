"""Running the gateway: one worker process, or a supervisor of N workers sharing a port.

With `--workers N` the supervisor (`cluster.supervisor`) starts N `gateway serve` processes that
bind the same port with SO_REUSEPORT, so the kernel spreads connections over them and each runs its
own event loop on its own core. They are one gateway: health is probed once, rate limits, admin
writes, /metrics and the comparison cover every worker (`cluster.hub`), and a worker that dies is
restarted. Prefix placement agrees across workers without sharing anything (rendezvous hashing).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import build_check
from .admin.reload import Reloads
from .app import Running, start
from .settings import ConfigError, EndpointPicker, PickerListen, Settings
from .state.reload import ReloadRejected

if TYPE_CHECKING:
    from .cluster.link import WorkerLink

log = logging.getLogger(__name__)


class _Signals:
    """SIGINT/SIGTERM call `stop`; SIGHUP reloads the config through what `reloader()` returns then
    (None: nothing to reload yet). One worker and the supervisor of N install the same handlers;
    `done` says in the log what a reload reached. Installed before the gateway says it is
    listening, so no signal can arrive to the default handlers."""

    def __init__(self, stop: Callable[[], None], reloader: Callable[[], Reloads | None], *,
                 done: str = "reloaded") -> None:
        self._reloader = reloader
        self._done = done
        self._tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)

    def _on_hup(self) -> None:
        task = asyncio.create_task(self._reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload(self) -> None:
        reloader = self._reloader()
        if reloader is None:
            log.warning("SIGHUP: nothing to reload")
            return
        try:
            done = await reloader.reload()
            log.info("SIGHUP: %s, generation %d", self._done, done.generation)
        except ReloadRejected as exc:
            log.error("SIGHUP: new config rejected, the old one keeps serving: %s", "; ".join(exc.errors))


async def serve(
    settings: Settings | None, *, host: str | None, port: int | None, workers: int = 1, reuse_port: bool = False,
    config_path: str | None = None, hub: str | None = None, worker_slot: int = 0, config_text: str | None = None,
    picker_port: int | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT; the exit status. `hub` (with `worker_slot`): this is a worker of
    the supervisor listening there (it serves the supervisor's committed generation, not a file, and
    stops when the supervisor goes). `config_text`: the config file's text as it was checked (what a
    supervisor commits as its first generation)."""
    if hub is not None:
        return await _serve_worker(host=host, port=port, reuse_port=reuse_port, hub=hub, worker_slot=worker_slot)
    demo = None
    if settings is None:
        from backends.emulator.fleet import DEMO_BASE_PORT

        from .demo import start_demo

        # behind Envoy, the fleet is where deploy/envoy/envoy.yaml's pool expects it
        demo = await start_demo(host=host or "127.0.0.1", base_port=DEMO_BASE_PORT if picker_port is not None else None)
        settings = demo.settings
    if picker_port is not None:  # `serve --picker-port`: the Endpoint Picker too, on the listen host
        picker = EndpointPicker(listen=PickerListen(host=host or settings.listen.host, port=picker_port))
        settings = settings.model_copy(update={"endpoint_picker": picker})
    host = host or settings.listen.host
    port = settings.listen.port if port is None else port
    try:
        if workers > 1:
            return await _supervise(settings, host=host, port=port, workers=workers, config_path=config_path,
                                    config_text=config_text, banner=demo.banner if demo is not None else None)
        return await _run(settings, host=host, port=port, reuse_port=reuse_port, config_path=config_path,
                          banner=demo.banner if demo is not None else None)
    finally:
        if demo is not None:
            await demo.stop()


async def _serve_worker(*, host: str | None, port: int | None, reuse_port: bool, hub: str, worker_slot: int) -> int:
    """A worker of the supervisor listening on `hub`: its config is the committed generation it is
    sent (exit status 2 when that cannot be built here, e.g. a tokenizer that no longer loads)."""
    from .cluster.link import WorkerLink

    link = await WorkerLink.connect(hub, worker_slot)
    try:
        checked = link.check()
    except ConfigError as exc:
        log.error("worker %d cannot build the committed generation %d: %s", worker_slot, link.generation,
                  "; ".join(exc.errors))
        await link.close()
        return 2
    settings = checked.settings
    host = host or settings.listen.host
    port = settings.listen.port if port is None else port
    return await _run(settings, host=host, port=port, reuse_port=reuse_port, link=link)


async def _run(
    settings: Settings, *, host: str, port: int, reuse_port: bool, config_path: str | None = None,
    link: WorkerLink | None = None, banner: Callable[[str], str] | None = None,
) -> int:
    stopped = asyncio.Event()
    worker: Running | None = None
    _Signals(stopped.set, lambda: None if worker is None else worker.built.coordinator)
    worker = await _start_worker(settings, host=host, port=port, reuse_port=reuse_port, config_path=config_path,
                                 link=link)
    if banner is not None:
        print(banner(worker.url), flush=True)
    ended = [asyncio.ensure_future(stopped.wait())]
    if link is not None:
        ended.append(asyncio.ensure_future(link.closed.wait()))
    await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
    for waiter in ended:
        waiter.cancel()
    if link is not None and link.closed.is_set() and not stopped.is_set():
        log.warning("the supervisor is gone: stopping this worker")
    log.info("shutting down: draining in-flight requests for up to %.0f s", settings.limits.drain_timeout_s)
    await worker.stop(settings.limits.drain_timeout_s)
    if link is not None:
        await link.close()
    return 0


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
    settings: Settings, *, host: str, port: int, reuse_port: bool, config_path: str | None = None,
    link: WorkerLink | None = None,
) -> Running:
    running = await start(settings, host=host, port=port, reuse_port=reuse_port, config_path=config_path,
                          link=link)
    _tune_gc()
    log.info("build: %s", build_check.describe())
    print(f"gateway listening on {running.url}", flush=True)
    if running.metrics_url is not None:
        print(f"metrics on {running.metrics_url}", flush=True)
    if running.picker_port is not None and settings.endpoint_picker is not None:
        print(f"endpoint picker (Envoy ext_proc, gRPC) on {settings.endpoint_picker.listen.host}:{running.picker_port}",
              flush=True)
    return running


async def _supervise(
    settings: Settings, *, host: str, port: int, workers: int, config_path: str | None, config_text: str | None,
    banner: Callable[[str], str] | None,
) -> int:
    """Run `workers` worker processes on one port until a signal stops them; the exit status."""
    from .app import build_pool
    from .cluster.committed import Committed
    from .cluster.supervisor import Supervisor

    first = Committed.first(settings, text=config_text, source=config_path or "<config>")
    supervisor = Supervisor(first, host=host, port=port, workers=workers, config_path=config_path,
                            build_pool=build_pool)
    _Signals(supervisor.stop, lambda: supervisor.hub, done="reloaded every worker")

    def listening(url: str) -> None:
        up = supervisor.serving
        print(f"gateway listening on {url} ({workers if up == workers else f'{up} of {workers}'} workers)",
              flush=True)
        if banner is not None:
            print(banner(url), flush=True)

    return await supervisor.run(listening)
