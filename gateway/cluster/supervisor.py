"""`gateway serve --workers N`: the supervisor starts N workers on one port, restarts the ones that
die, and stops them all together.

Workers are `gateway serve --reuse-port` processes that bind the same port (SO_REUSEPORT: the kernel
spreads connections over them, each runs its own event loop on its own core) and connect to the
supervisor's hub (`hub`) over a Unix socket in a private (0700) temporary directory before they
build anything.

- Start: all N start at once; the supervisor prints `gateway listening on URL (N workers)` once every
  one of them listens. If one cannot start (it exits, or says nothing within `START_TIMEOUT_S`), the
  supervisor stops the others and exits with status 1.
- Crash: a worker that exits while the gateway runs is logged and restarted after a backoff that
  doubles with each exit of that slot within `BACKOFF_RESET_S` (0.5 s, 1 s, 2 s ... at most
  `BACKOFF_MAX_S`), counted in `gateway_worker_restarts_total`. A slot whose replacement fails to
  start `MAX_START_FAILURES` times in a row makes the supervisor give up: it stops everything and
  exits with status 1 (a crash loop is not a gateway).
- SIGHUP reloads every worker through the hub (`Hub.reload`); SIGTERM/SIGINT stop the workers (each
  drains its requests for up to `limits.drain_timeout_s`) and the supervisor exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import yaml

from ..settings import Settings
from ..state.pool import Pool
from .hub import Hub

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
BACKOFF_S = 0.5
BACKOFF_MAX_S = 15.0
BACKOFF_RESET_S = 60.0
MAX_START_FAILURES = 5


class StartFailed(RuntimeError):
    """A worker exited, or said nothing, before it listened."""


class Slot:
    """One worker position: the process now in it and its recent exits."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.proc: asyncio.subprocess.Process | None = None
        self.exits: list[float] = []  # monotonic times of recent unexpected exits
        self.start_failures = 0
        self._drain: asyncio.Task[None] | None = None

    def backoff_s(self, now: float, first_s: float = BACKOFF_S) -> float:
        self.exits = [t for t in self.exits if now - t < BACKOFF_RESET_S]
        return float(min(first_s * 2 ** max(len(self.exits) - 1, 0), BACKOFF_MAX_S))

    async def start(self, argv: list[str]) -> None:
        proc = self.proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                line = (await proc.stdout.readline()).decode()
        except TimeoutError:
            line = ""
        if not line.startswith("gateway listening on "):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            code = await proc.wait()
            raise StartFailed(f"worker {self.number} did not start (exit status {code}; its log is above)")
        self._drain = asyncio.get_running_loop().create_task(_drain(proc.stdout))

    async def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            await proc.wait()
        if self._drain is not None:
            self._drain.cancel()


async def _drain(stream: asyncio.StreamReader) -> None:
    """Read what a worker prints after it started (so that its pipe never fills up)."""
    while await stream.readline():
        pass


class Supervisor:
    def __init__(
        self, settings: Settings, *, host: str, port: int, workers: int, config_path: str | None,
        build_pool: Callable[[Settings], Pool], backoff_s: float = BACKOFF_S,
        worker_argv: Callable[[Path, Path, int], list[str]] | None = None,
    ) -> None:
        """`worker_argv(config, hub socket, slot)`: how a worker is started (default: `gateway serve`)."""
        self.settings = settings
        self.backoff_first_s = backoff_s
        self._worker_argv = worker_argv
        self.host = host
        self.port = port
        self.slots = [Slot(i) for i in range(workers)]
        self._config_path = config_path
        self._build_pool = build_pool
        self.hub: Hub | None = None
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def stop(self) -> None:
        self._stop.set()

    def _argv(self, config: Path, hub_socket: Path, slot: Slot) -> list[str]:
        if self._worker_argv is not None:
            return self._worker_argv(config, hub_socket, slot.number)
        return [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--host", self.host,
                "--port", str(self.port), "--reuse-port", "--hub", str(hub_socket), "--worker-slot", str(slot.number)]

    async def run(self, on_listening: Callable[[str], None]) -> int:
        """Run until stopped; the exit status (0, or 1 when a worker could not start)."""
        holder = None
        if self.port == 0:  # reserve a concrete port that every worker can then bind with SO_REUSEPORT
            holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            holder.bind((self.host, 0))
            self.port = holder.getsockname()[1]
        with tempfile.TemporaryDirectory(prefix="gateway-") as tmp:  # created 0700: only we reach the hub
            config = Path(self._config_path) if self._config_path is not None else Path(tmp) / "gateway.yaml"
            if self._config_path is None:
                config.write_text(yaml.safe_dump(self.settings.model_dump(mode="json")))
            hub_socket = Path(tmp) / "hub.sock"
            hub = self.hub = Hub(self.settings, config_path=str(config) if self._config_path else None,
                                 build_pool=self._build_pool)
            hub.expected_workers = len(self.slots)
            try:
                await hub.start(hub_socket)
                try:
                    await asyncio.gather(*(s.start(self._argv(config, hub_socket, s)) for s in self.slots))
                except StartFailed as exc:
                    log.error("%s: stopping the gateway", exc)
                    return 1
                if holder is not None:
                    holder.close()
                    holder = None
                url = f"http://{self.host}:{self.port}"
                on_listening(url)
                for slot in self.slots:
                    self._spawn(self._watch(slot, config, hub_socket))
                await self._stop.wait()
                return self.exit_code
            finally:
                for task in self._tasks:
                    task.cancel()
                await asyncio.gather(*(s.stop() for s in self.slots))
                await hub.stop()
                if holder is not None:
                    holder.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, slot: Slot, config: Path, hub_socket: Path) -> None:
        """Restart the slot's worker whenever it exits, until the gateway stops."""
        while True:
            assert slot.proc is not None
            code = await slot.proc.wait()
            if self._stop.is_set():
                return
            now = time.monotonic()
            slot.exits.append(now)
            delay = slot.backoff_s(now, self.backoff_first_s)
            log.error("worker %d (pid %d) exited with status %s; restarting it in %.1f s", slot.number,
                      slot.proc.pid, code, delay)
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._stop.wait()
                if self._stop.is_set():
                    return
                try:
                    await slot.start(self._argv(config, hub_socket, slot))
                except StartFailed as exc:
                    slot.start_failures += 1
                    if slot.start_failures >= MAX_START_FAILURES:
                        log.error("%s, %d times in a row: giving up, stopping the gateway", exc, slot.start_failures)
                        self.exit_code = 1
                        self._stop.set()
                        return
                    delay = min(delay * 2, BACKOFF_MAX_S)
                    log.error("%s; trying again in %.1f s", exc, delay)
                    continue
                slot.start_failures = 0
                assert self.hub is not None
                assert slot.proc is not None
                self.hub.restarted()
                log.warning("worker %d restarted (pid %d)", slot.number, slot.proc.pid)
                break

