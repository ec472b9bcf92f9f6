"""The gateway's own health on /metrics: what an operator checks before blaming a backend.

- `gateway_event_loop_lag_seconds` (histogram): how late a periodic timer fires. Every request of a
  worker shares one event loop, so a callback that holds it (CPU-bound work, a blocking call, a GC
  pause) delays every stream by as much; this is the first thing to look at when TTFT rises at the
  gateway but not at the engines.
- `gateway_open_connections{side}`: open client and upstream connections, read from callables at
  scrape time (the owners of the connections supply them), to compare with `process_max_fds`.
- `process_*` from prometheus_client's ProcessCollector: CPU seconds, resident and virtual memory,
  open and maximum file descriptors, start time (Linux /proc).
- `gateway_build_info{version, build}` = 1: the package version, and `native` when the request path
  runs compiled (mypyc) or `pure` when it runs the Python sources.

All of it is per process: with several workers each reports its own, and the merge rules declared
below (`gateway.merge_rules`) sum CPU, memory, connections and the lag histogram, keep the oldest
start time and the one build, and keep the descriptor pair per worker (the limit is per process).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily

from .. import build_check
from ..merge_rules import Merge, declare

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DISTRIBUTION = "moe-inference-gateway"


class LoopLagMonitor:
    """Measures event-loop lag: how much later than asked a sleep of `interval_s` returns.

    One timer per interval is the whole cost (4 wake-ups a second by default). The lag is observed
    into `gateway_event_loop_lag_seconds`; a loop held for longer than the interval shows up as one
    large observation when it lets go, which is what the alert on the histogram's upper quantiles
    looks for. `clock` and `sleep` are injectable so the measurement is testable without waiting.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self.histogram = Histogram(
            "gateway_event_loop_lag_seconds",
            f"How late a {interval_s} s timer fired on this process's event loop.",
            buckets=LAG_BUCKETS, registry=registry,
        )

    async def measure_once(self) -> float:
        """Sleep one interval and observe (and return) how late it ended."""
        start = self._clock()
        await self._sleep(self.interval_s)
        lag = max(self._clock() - start - self.interval_s, 0.0)
        self.histogram.observe(lag)
        return lag

    async def run(self) -> None:
        """Measure until cancelled."""
        while True:
            await self.measure_once()


class ConnectionGauges:
    """`gateway_open_connections{side}`: each side's count comes from a callable read at scrape time,
    so the request path never updates a gauge. A side whose callable raises is left out of that
    scrape rather than failing the whole /metrics page."""

    def __init__(self, sources: Mapping[str, Callable[[], int]] | None = None) -> None:
        self._sources: dict[str, Callable[[], int]] = dict(sources or {})

    def add(self, side: str, count: Callable[[], int]) -> None:
        """Count `side` ("client", "upstream", ...) with `count()` from now on (replaces an earlier one)."""
        self._sources[side] = count

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "gateway_open_connections", "Open connections of this process, by side (client, upstream).",
            labels=["side"],
        )
        for side, count in sorted(self._sources.items()):
            with contextlib.suppress(Exception):
                family.add_metric([side], float(count()))
        yield family


def build_kind() -> str:
    """`native` when modules of the gateway were imported compiled, else `pure`."""
    return "native" if build_check.describe().startswith("native") else "pure"


def package_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


class BuildInfo:
    """`gateway_build_info{version, build}` = 1, fixed when constructed (after the request path is
    imported, so `build` says what actually runs)."""

    def __init__(self, *, version: str | None = None, build: str | None = None) -> None:
        self.version = version if version is not None else package_version()
        self.build = build if build is not None else build_kind()

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "gateway_build_info", "Always 1: the gateway's version and build (native = mypyc-compiled, pure).",
            labels=["version", "build"],
        )
        family.add_metric([self.version, self.build], 1.0)
        yield family


declare(Merge.SUM, "gateway_event_loop_lag_seconds", "gateway_open_connections", "process_cpu_seconds_total",
        "process_resident_memory_bytes", "process_virtual_memory_bytes")
declare(Merge.MIN, "process_start_time_seconds")
declare(Merge.MAX, "gateway_build_info")  # every worker runs the one build
declare(Merge.WORKER, "process_open_fds", "process_max_fds")


class SelfHealth:
    """Registers every self-health family on `registry`; `lifetime` runs the lag probe (use it as an
    aiohttp `cleanup_ctx`, or `async with` it)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        connections: Mapping[str, Callable[[], int]] | None = None,
        lag_interval_s: float = 0.25,
    ) -> None:
        ProcessCollector(registry=registry)
        self.build = BuildInfo()
        registry.register(self.build)
        self.connections = ConnectionGauges(connections)
        registry.register(self.connections)
        self.lag = LoopLagMonitor(registry, interval_s=lag_interval_s)
        self._probe: asyncio.Task[None] | None = None

    @property
    def probing(self) -> bool:
        """True while the event-loop probe runs."""
        return self._probe is not None and not self._probe.done()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[SelfHealth]:
        task = self._probe = asyncio.get_running_loop().create_task(self.lag.run())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def lifetime(self, _app: object) -> AsyncIterator[None]:
        """aiohttp cleanup context: the probe runs while the application does."""
        async with self.running():
            yield
