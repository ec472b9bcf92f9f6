"""`gateway serve --workers N`: the supervisor starts N workers on one port, restarts the ones that
die, and stops them all together.

Workers are `gateway serve --reuse-port` processes that bind the same port (SO_REUSEPORT: the kernel
spreads connections over them, each runs its own event loop on its own core) and connect to the
supervisor's hub (`hub`) over a Unix socket in a private (0700) temporary directory before they
build anything. They build the hub's committed generation (`committed`), never the config file: a
worker started at any time runs exactly what its siblings run.

- Start: all N start at once. The supervisor prints `gateway listening on URL (N workers)` once each
  has listened or failed. If none could start (it exits, or says nothing within `START_TIMEOUT_S`),
  nothing can serve (the port is taken, the host cannot run a worker): the supervisor stops and
  exits with status 1, so that the operator (or the service manager) sees it at once. If some
  could, it serves with them (`(K of N workers)`) and the others are slots down, as below.
- Crash: a worker that exits while the gateway runs is logged and restarted after a backoff that
  doubles with each exit of that slot within `BACKOFF_RESET_S` (0.5 s, 1 s, 2 s ... at most
  `BACKOFF_MAX_S`), counted in `gateway_worker_restarts_total`.
- A slot whose worker cannot start stays down and is retried with the same backoff for as long as
  the gateway runs (`retrying.forever`, on the injected sleep): it is reported in `/admin/workers`
  (`down`: the slot, since when, its failures, the last error), in the log and in
  `gateway_worker_slots_down` and `gateway_worker_start_failures_total`. It never stops the
  supervisor or the workers that serve.
- SIGHUP reloads every worker through the hub (`Hub.reload`); SIGTERM/SIGINT stop the workers (each
  drains its requests for up to `limits.drain_timeout_s`) and the supervisor exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from ..retrying import Backoff, forever
from ..settings import Settings
from ..state.pool import Pool
from .committed import Committed
from .hub import Hub

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
BACKOFF_S = 0.5
BACKOFF_MAX_S = 15.0
BACKOFF_RESET_S = 60.0


class StartFailed(RuntimeError):
    """A worker exited, or said nothing, before it listened."""


class Slot:
    """One worker position: the process now in it, its recent exits, and why it is down if it is."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.proc: asyncio.subprocess.Process | None = None
        self.exits: list[float] = []  # times of recent unexpected exits
        self.down_since: float | None = None
        self.failures = 0  # failed starts since it went down
        self.last_error: str | None = None
        self._drain: asyncio.Task[None] | None = None

    def exited(self, now: float, backoff: Backoff) -> float:
        """Its worker exited at `now`: how long to wait before starting another."""
        self.exits = [t for t in self.exits if now - t < BACKOFF_RESET_S] + [now]
        return backoff.delay(len(self.exits))

    def went_down(self, error: str, now: float, *, failed_start: bool) -> None:
        if self.down_since is None:
            self.down_since = now
        self.failures += failed_start
        self.last_error = error

    def came_up(self) -> None:
        self.down_since, self.failures, self.last_error = None, 0, None

    def report(self, now: float) -> dict[str, Any] | None:
        if self.down_since is None:
            return None
        return {"worker": self.number, "down_s": now - self.down_since, "failed_starts": self.failures,
                "last_error": self.last_error}

    async def start(self, argv: list[str]) -> None:
        try:
            proc = self.proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
        except OSError as exc:
            raise StartFailed(f"worker {self.number} could not be started: {exc}") from exc
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
        self, committed: Committed, *, host: str, port: int, workers: int, config_path: str | None,
        build_pool: Callable[[Settings], Pool], backoff_s: float = BACKOFF_S,
        worker_argv: Callable[[Path, int], list[str]] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`worker_argv(hub socket, slot)`: how a worker is started (default: `gateway serve`)."""
        self.committed = committed
        self.backoff = Backoff(backoff_s, BACKOFF_MAX_S, rng=rng)
        self._sleep = sleep
        self._clock = clock
        self._worker_argv = worker_argv
        self.host = host
        self.port = port
        self.slots = [Slot(i) for i in range(workers)]
        self._config_path = config_path
        self._build_pool = build_pool
        self.hub: Hub | None = None
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def stop(self) -> None:
        self._stop.set()

    @property
    def serving(self) -> int:
        """Slots whose worker is up."""
        return sum(1 for s in self.slots if s.down_since is None and s.proc is not None)

    def slots_down(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [r for r in (s.report(now) for s in self.slots) if r is not None]

    def _argv(self, hub_socket: Path, slot: Slot) -> list[str]:
        if self._worker_argv is not None:
            return self._worker_argv(hub_socket, slot.number)
        return [sys.executable, "-m", "gateway", "serve", "--host", self.host, "--port", str(self.port),
                "--reuse-port", "--hub", str(hub_socket), "--worker-slot", str(slot.number)]

    async def run(self, on_listening: Callable[[str], None]) -> int:
        """Run until stopped; the exit status (0, or 1 when no worker could start)."""
        holder = None
        if self.port == 0:  # reserve a concrete port that every worker can then bind with SO_REUSEPORT
            holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            holder.bind((self.host, 0))
            self.port = holder.getsockname()[1]
        with tempfile.TemporaryDirectory(prefix="gateway-") as tmp:  # created 0700: only we reach the hub
            hub_socket = Path(tmp) / "hub.sock"
            hub = self.hub = Hub(self.committed, config_path=self._config_path, build_pool=self._build_pool)
            hub.expected_workers = len(self.slots)
            hub.slots_down = self.slots_down
            try:
                await hub.start(hub_socket)
                started = await asyncio.gather(*(self._first_start(s, hub_socket) for s in self.slots))
                if not any(started):
                    log.error("no worker could start: stopping the gateway")
                    return 1
                if holder is not None:
                    holder.close()
                    holder = None
                on_listening(f"http://{self.host}:{self.port}")
                for slot, up in zip(self.slots, started, strict=True):
                    self._spawn(self._keep(slot, hub_socket, up=up))
                await self._stop.wait()
                return 0
            finally:
                for task in self._tasks:
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                await asyncio.gather(*(s.stop() for s in self.slots))
                await hub.stop()
                if holder is not None:
                    holder.close()

    async def _first_start(self, slot: Slot, hub_socket: Path) -> bool:
        try:
            await slot.start(self._argv(hub_socket, slot))
        except StartFailed as exc:
            self._failed(slot, exc)
            log.error("%s: the slot stays down and is retried", exc)
            return False
        return True

    def _failed(self, slot: Slot, exc: StartFailed) -> None:
        slot.went_down(str(exc), self._clock(), failed_start=True)
        if self.hub is not None:
            self.hub.start_failures.inc()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _keep(self, slot: Slot, hub_socket: Path, *, up: bool) -> None:
        """Keep a worker in the slot until the gateway stops: restart it whenever it exits."""
        if not up:
            await self._sleep(self.backoff.delay(1))
            await self._bring_up(slot, hub_socket)
        while True:
            assert slot.proc is not None
            code = await slot.proc.wait()
            if self._stop.is_set():
                return
            now = self._clock()
            delay = slot.exited(now, self.backoff)
            slot.went_down(f"exited with status {code}", now, failed_start=False)
            log.error("worker %d (pid %d) exited with status %s; restarting it in %.1f s", slot.number,
                      slot.proc.pid, code, delay)
            await self._sleep(delay)
            await self._bring_up(slot, hub_socket)
            assert self.hub is not None
            self.hub.restarted()
            log.warning("worker %d restarted (pid %d)", slot.number, slot.proc.pid)

    async def _bring_up(self, slot: Slot, hub_socket: Path) -> None:
        """Start the slot's worker, again and again with backoff until one listens."""
        async for attempt in forever(wait=self.backoff, sleep=self._sleep, retry_on=StartFailed, log=log,
                                     what=f"starting worker {slot.number}"):
            with attempt:
                try:
                    await slot.start(self._argv(hub_socket, slot))
                except StartFailed as exc:
                    self._failed(slot, exc)
                    raise
        slot.came_up()
