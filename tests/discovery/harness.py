"""Drive discovery sources step by step against real servers on loopback.

A source sleeps only through the `sleep` it is given. `StepSleep` is that sleep: it records the delay
asked for and waits until the test calls `step()`, which returns once the source has made exactly
one more attempt and is asleep again (or `wake()`, which does not wait: for a watch that then
lasts). So a test says "try once more" instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.discovery import Change, DiscoveryMetrics, Endpoint, Source, changes
from gateway.discovery.hysteresis import LITERAL, Hold
from tests.polling import until


class StepSleep:
    def __init__(self) -> None:
        self.asked: list[float] = []
        self._permits = asyncio.Semaphore(0)

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        await self._permits.acquire()

    async def asleep(self, count: int = 1, within_s: float = 10.0) -> None:
        """Wait until the source has gone to sleep `count` times in all."""
        await until(lambda: len(self.asked) >= count, within_s)

    def wake(self) -> None:
        """End the current sleep (the source goes on: one more attempt, or a watch that lasts)."""
        self._permits.release()

    async def step(self, within_s: float = 10.0) -> None:
        """End the current sleep and wait until the source sleeps again (one more attempt made)."""
        before = len(self.asked)
        self.wake()
        await until(lambda: len(self.asked) > before, within_s)


class Follower:
    """`changes(source)` in a task, recording every change and counting on its own registry."""

    def __init__(self, source: Source, *, hold: Hold = LITERAL, clock: Callable[[], float] = lambda: 100.0) -> None:
        self.registry = CollectorRegistry()
        self.seen: list[Change] = []
        self._task = asyncio.create_task(self._follow(source, DiscoveryMetrics(self.registry), hold, clock))

    async def _follow(self, source: Source, metrics: DiscoveryMetrics, hold: Hold, clock: Callable[[], float]) -> None:
        async for change in changes(source, metrics=metrics, hold=hold, clock=clock):
            self.seen.append(change)

    @property
    def sets(self) -> list[frozenset[Endpoint]]:
        return [c.endpoints for c in self.seen]

    async def changed(self, count: int, within_s: float = 10.0) -> frozenset[Endpoint]:
        """Wait for the `count`-th change; return its endpoint set."""
        await until(lambda: len(self.seen) >= count or self._task.done(), within_s)
        if self._task.done():
            self._task.result()  # a source must never end: surface its exception
            raise AssertionError("the source ended")
        return self.seen[count - 1].endpoints

    def metric(self, name: str, source: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, {"source": source, **labels}) or 0.0

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


Follow = Callable[..., tuple[Follower, StepSleep]]  # the `follow` fixture: entry -> (follower, its sleep)


def endpoints(port: int, *addresses: str) -> frozenset[Endpoint]:
    return frozenset(Endpoint.of(a, port) for a in addresses)


def dnsmasq_binary() -> str:
    """dnsmasq (Debian's dnsmasq-base, installed by `make system-deps`): missing is a failure in CI."""
    found = shutil.which("dnsmasq") or ("/usr/sbin/dnsmasq" if os.access("/usr/sbin/dnsmasq", os.X_OK) else None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("dnsmasq is missing (apt-get install dnsmasq-base; `make system-deps` does it)")
        pytest.skip("dnsmasq is not installed (apt-get install dnsmasq-base, or `make system-deps`)")
    return found


def free_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1 (dnsmasq listens on both)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port")


class Dnsmasq:
    """A real dnsmasq on 127.0.0.1, answering for `*.test` from a hosts file it re-reads on SIGHUP.

    SRV records (`--srv-host`) are command-line options, which SIGHUP does not re-read: changing
    them means `restart(srv=...)`. Names under `.test` that the hosts file lacks get NXDOMAIN.
    """

    def __init__(self, directory: Path) -> None:
        self.binary = dnsmasq_binary()
        self.port = free_port()
        self.hosts = directory / "hosts"
        self.log = directory / "dnsmasq.log"
        self.hosts.write_text("")
        self._proc: subprocess.Popen[bytes] | None = None
        self._srv: list[str] = []

    @property
    def resolver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def write_hosts(self, names: dict[str, Iterable[str]]) -> None:
        self.hosts.write_text("".join(f"{address} {name}\n" for name, addrs in names.items() for address in addrs))

    def _reads(self) -> int:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text.count(f"read {self.hosts} - ")

    def start(self, srv: Iterable[str] = ()) -> None:
        self._srv = list(srv)
        reads = self._reads()
        args = [
            self.binary, "--no-daemon", f"--port={self.port}", "--listen-address=127.0.0.1", "--bind-interfaces",
            "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}", "--local=/test/", "--log-queries",
            "--log-facility=-", "--conf-file=/dev/null", "--pid-file", f"--user={getpass.getuser()}",
            *(f"--srv-host={s}" for s in self._srv),
        ]
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while self._reads() <= reads:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dnsmasq did not start: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)

    def reload(self) -> None:
        """SIGHUP: dnsmasq re-reads the hosts file. Returns once it says it has."""
        assert self._proc is not None
        reads = self._reads()
        self._proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while self._reads() <= reads:
            if time.monotonic() > deadline:
                raise RuntimeError("dnsmasq did not re-read its hosts file")
            time.sleep(0.02)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            self._proc = None

    def restart(self, srv: Iterable[str] | None = None) -> None:
        self.stop()
        self.start(self._srv if srv is None else srv)
