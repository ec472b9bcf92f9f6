"""The self-health, price and per-arm families, read back the way Prometheus reads them."""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
from collections.abc import Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.base import Runtime, Usage
from gateway import build_check
from gateway.observability import (
    ArmMetrics,
    BuildInfo,
    ConnectionGauges,
    LoopLagMonitor,
    PriceCollector,
    SelfHealth,
    install,
)
from gateway.observability.outcome import Gaps, Outcome
from gateway.settings import Backend


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """{sorted label pairs: value} of every sample called `name`, parsed from the text exposition."""
    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name == name:
                found[tuple(sorted(s.labels.items()))] = s.value
    return found


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return samples(registry, name).get(tuple(sorted(labels.items())))


class FakeTime:
    """A clock and a sleep that advances it by the requested time plus `late_s`."""

    def __init__(self, late_s: float) -> None:
        self.now = 100.0
        self.late_s = late_s

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds + self.late_s


async def eventually_async(condition: Callable[[], bool]) -> None:
    """Poll `condition` on the running loop for up to 5 s."""
    async with asyncio.timeout(5):
        while not condition():  # noqa: ASYNC110 - a scraped value has no event to wait on
            await asyncio.sleep(0.01)


async def test_lag_is_how_late_the_timer_fired() -> None:
    registry = CollectorRegistry()
    fake = FakeTime(late_s=0.3)
    monitor = LoopLagMonitor(registry, interval_s=0.25, clock=fake.clock, sleep=fake.sleep)
    assert await monitor.measure_once() == pytest.approx(0.3)
    fake.late_s = 0.0
    assert await monitor.measure_once() == 0.0
    assert value(registry, "gateway_event_loop_lag_seconds_count") == 2
    assert value(registry, "gateway_event_loop_lag_seconds_sum") == pytest.approx(0.3)
    assert value(registry, "gateway_event_loop_lag_seconds_bucket", le="0.25") == 1
    assert value(registry, "gateway_event_loop_lag_seconds_bucket", le="0.5") == 2


async def test_a_blocked_loop_shows_as_lag() -> None:
    registry = CollectorRegistry()
    monitor = LoopLagMonitor(registry, interval_s=0.02)
    task = asyncio.get_running_loop().create_task(monitor.run())
    try:
        asyncio.get_running_loop().call_soon(time.sleep, 0.3)  # the load under test: a callback holds the loop
        await eventually_async(lambda: (value(registry, "gateway_event_loop_lag_seconds_bucket", le="0.1") or 0) < (
            value(registry, "gateway_event_loop_lag_seconds_count") or 0))
    finally:
        task.cancel()
    assert (value(registry, "gateway_event_loop_lag_seconds_sum") or 0) >= 0.2


def test_connections_are_read_at_scrape_time_and_a_failing_source_is_left_out() -> None:
    registry = CollectorRegistry()
    open_now = [3]
    gauges = ConnectionGauges({"client": lambda: open_now[0]})

    def broken() -> int:
        raise RuntimeError("gone")

    gauges.add("upstream", broken)
    registry.register(gauges)
    assert samples(registry, "gateway_open_connections") == {(("side", "client"),): 3.0}
    open_now[0] = 7
    gauges.add("upstream", lambda: 2)
    assert samples(registry, "gateway_open_connections") == {(("side", "client"),): 7.0, (("side", "upstream"),): 2.0}


def test_build_info_names_the_version_and_the_build_that_runs() -> None:
    registry = CollectorRegistry()
    registry.register(BuildInfo())
    build = "native" if build_check.compiled() else "pure"  # what is on disk agrees with what was imported
    version = importlib.metadata.version("moe-inference-gateway")
    assert samples(registry, "gateway_build_info") == {(("build", build), ("version", version)): 1.0}


def test_self_health_registers_process_families() -> None:
    registry = CollectorRegistry()
    SelfHealth(registry)
    open_fds = value(registry, "process_open_fds")
    max_fds = value(registry, "process_max_fds")
    assert open_fds is not None
    assert max_fds is not None
    assert 0 < open_fds < max_fds
    assert (value(registry, "process_resident_memory_bytes") or 0) > 1e6
    assert value(registry, "process_cpu_seconds_total") is not None
    assert value(registry, "gateway_open_connections") is None  # no source yet: an empty family


def test_prices_follow_the_live_config_and_skip_unpriced_backends() -> None:
    def backend(name: str, runtime: Runtime, usd: float | None) -> Backend:
        return Backend(name=name, runtime=runtime, url="http://127.0.0.1:1", model="m", usd_per_hour=usd)

    live = [backend("v", Runtime.VLLM, 28.0), backend("s", Runtime.SGLANG, None)]
    registry = CollectorRegistry()
    registry.register(PriceCollector(lambda: live))
    assert samples(registry, "gateway_backend_usd_per_hour") == {(("backend", "v"), ("runtime", "vllm")): 28.0}
    live = [backend("v", Runtime.VLLM, 30.0), backend("s", Runtime.SGLANG, 12.5)]
    assert samples(registry, "gateway_backend_usd_per_hour") == {
        (("backend", "v"), ("runtime", "vllm")): 30.0, (("backend", "s"), ("runtime", "sglang")): 12.5,
    }


def test_arm_families_count_only_requests_that_carried_an_arm() -> None:
    registry = CollectorRegistry()
    arms = ArmMetrics(registry)
    usage = Usage(prompt_tokens=10, completion_tokens=4)
    for arm, status in (("a", "200"), ("a", "200"), ("a", "502"), ("b", "200"), (None, "200")):
        arms.record(Outcome(backend="x", runtime="vllm", model="m", status=status, duration_s=0.5,
                            usage=usage if status == "200" else None, ttft_s=0.05, gaps=Gaps.of((0.01, 0.02, 0.03)),
                            arm=arm))
    assert samples(registry, "gateway_arm_responses_total") == {
        (("arm", "a"), ("model", "m"), ("status", "200")): 2.0,
        (("arm", "a"), ("model", "m"), ("status", "502")): 1.0,
        (("arm", "b"), ("model", "m"), ("status", "200")): 1.0,
    }
    assert value(registry, "gateway_arm_tokens_total", model="m", arm="a", kind="completion") == 8
    assert value(registry, "gateway_arm_tokens_total", model="m", arm="b", kind="prompt") == 10
    assert value(registry, "gateway_arm_time_to_first_token_seconds_count", model="m", arm="a") == 3
    assert value(registry, "gateway_arm_inter_token_latency_seconds_count", model="m", arm="b") == 3


async def test_install_runs_the_probe_while_the_app_runs_and_adds_the_arm_observer() -> None:
    registry = CollectorRegistry()
    observers: list[Callable[[Outcome], None]] = []
    app = web.Application()
    health = install(app, registry, backends=lambda: [], observers=observers)
    assert len(observers) == 1
    health.connections.add("client", lambda: 1)
    server = TestServer(app)
    await server.start_server()
    try:
        assert health.probing
        await eventually_async(lambda: (value(registry, "gateway_event_loop_lag_seconds_count") or 0) >= 2)
    finally:
        await server.close()
    assert not health.probing  # stopped with the application
    assert value(registry, "gateway_open_connections", side="client") == 1
    observers[0](Outcome(backend="x", runtime="vllm", model="m", status="200", duration_s=0.1, arm="a"))
    assert value(registry, "gateway_arm_responses_total", model="m", arm="a", status="200") == 1
