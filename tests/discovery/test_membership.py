"""Discovered backends joining and leaving a running gateway (`app.build`, served on a loopback socket,
asked through the OpenAI SDK) in front of real emulators. The discovery source is scripted (the
test says what it answers next); tests/integration/test_discovery.py runs the same against a real
dnsmasq and the Kubernetes stub, in a gateway process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry

from backends.base import Runtime
from backends.emulator import EmulatorConfig, Faults, RunningEmulator, start_emulator
from gateway.app import Built, build
from gateway.discovery import DiscoveryEntry, Endpoint, Failed, Observation, Resolved, Source
from gateway.proxy.service import proxy_of
from gateway.settings import load_settings
from tests.polling import until

# gateway/http/handlers.py keeps the request id under a str key (`request["request_id"]`), which this
# aiohttp warns about; in-process, the warnings filter would make that an error in every handler.


class ScriptedSource:
    """A discovery source that answers what the test `say`s, in order; it never ends by itself."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._said: asyncio.Queue[Observation] = asyncio.Queue()
        self.closed = False

    @property
    def name(self) -> str:
        return self._name

    def say(self, observation: Observation) -> None:
        self._said.put_nowait(observation)

    async def observe(self) -> AsyncGenerator[Observation, None]:
        try:
            while True:
                yield await self._said.get()
        finally:
            self.closed = True


def found(*emus: RunningEmulator) -> Resolved:
    return Resolved(frozenset(Endpoint.of("127.0.0.1", int(e.url.rsplit(":", 1)[1])) for e in emus))


def name_of(emu: RunningEmulator) -> str:
    return f"pool-127.0.0.1:{emu.url.rsplit(':', 1)[1]}"


@dataclass
class Gateway:
    built: Built
    url: str
    config: Path
    sources: list[ScriptedSource]
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient
    registry: CollectorRegistry

    @property
    def source(self) -> ScriptedSource:
        return self.sources[-1]

    async def ask(self, **extra: Any) -> tuple[str, str | None]:
        """One chat completion; (the backend that served it, its A/B arm)."""
        raw = await self.client.chat.completions.with_raw_response.create(
            model="moe", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra)
        assert raw.parse().choices[0].message.content is not None
        return raw.headers["x-gateway-backend"], raw.headers.get("x-gateway-arm")

    async def backends(self) -> dict[str, dict[str, Any]]:
        body = (await self.http.get("/admin/backends")).json()
        return {b["name"]: b for b in body["backends"]}

    async def generation(self) -> int:
        return int((await self.http.get("/admin/backends")).json()["generation"])

    async def compared(self) -> list[str]:
        body = (await self.http.get("/admin/compare", params={"window": 60})).json()
        return [row["name"] for row in body["backends"]]

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def reload(self, config: dict[str, Any]) -> None:
        self.config.write_text(yaml.safe_dump(config))
        response = await self.http.post("/admin/reload", headers={"Content-Type": "application/json"})
        assert response.status_code == 200, response.text


def config_of(*, price: float = 10.0, host: str = "pool.test", remember_s: float = 3600.0,
              **extra: Any) -> dict[str, Any]:
    """One DNS entry whose answers are followed literally (the scripted source says the whole set
    each time; the hold has tests of its own), and a round-robin route over its pool."""
    return {
        "discovery": [{"name": "pool", "runtime": "vllm", "model": "tiny-moe", "usd_per_hour": price,
                       "remember_s": remember_s,
                       "dns": {"host": host, "port": 8000, "leave_after_answers": 1, "leave_after_s": 0}}],
        "routes": [{"model": "moe", "backends": ["pool"], "policy": "round_robin"}],
        "health": {"interval_s": 0.05, "failure_threshold": 50},
        **extra,
    }


@pytest.fixture
async def emulators() -> AsyncIterator[Callable[..., Any]]:
    started: list[RunningEmulator] = []

    async def start(speed: float = 20.0, **faults: Any) -> RunningEmulator:
        cfg = EmulatorConfig(runtime=Runtime.VLLM, model="tiny-moe", profile="tiny", speed=speed,
                             faults=Faults(**faults))
        started.append(await start_emulator(cfg, host="127.0.0.1", port=0))
        return started[-1]

    yield start
    for emu in started:
        await emu.stop()


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    running: list[tuple[web.AppRunner, Gateway]] = []

    async def start(config: dict[str, Any]) -> Gateway:
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        sources: list[ScriptedSource] = []

        def make_source(entry: DiscoveryEntry) -> Source:
            sources.append(ScriptedSource(entry.name))
            return sources[-1]

        registry = CollectorRegistry()
        built = await build(load_settings(path), registry=registry, config_path=path, discovery_source=make_source)
        runner = web.AppRunner(built.app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        built.guard.admin_writes_open = True  # as app.start decides for a loopback-only listener
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        gw = Gateway(built, url, path, sources, openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0),
                     httpx.AsyncClient(base_url=url, timeout=10), registry)
        running.append((runner, gw))
        await until(lambda: len(sources) == len(config.get("discovery", [])))
        return gw

    yield start
    for runner, gw in running:
        await gw.client.close()
        await gw.http.aclose()
        await runner.cleanup()


async def wait_for(check: Callable[[], Any], within_s: float = 10.0) -> None:
    """Await `check()` until it is true (an async condition, polled with a deadline)."""
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_a_discovered_backend_is_probed_before_it_gets_traffic_then_joins_the_route(
    gateway: Callable[..., Any], emulators: Callable[..., Any],
) -> None:
    ready = await emulators()
    gw: Gateway = await gateway(config_of())
    assert (await gw.http.get("/ready")).status_code == 503  # nothing discovered yet
    gw.source.say(found(ready))
    await wait_for(lambda: ready_now(gw, name_of(ready)))
    assert (await gw.ask())[0] == name_of(ready)

    late = await emulators(not_ready_for_s=3.0)  # its readiness probe fails for 3 s from now
    gw.source.say(found(ready, late))
    burst = await asyncio.gather(*(gw.ask() for _ in range(20)))  # racing the join and its first probe
    assert {backend for backend, _ in burst} == {name_of(ready)}
    assert late.stats.rejected_not_ready == 0
    await wait_for(lambda: listed(gw, name_of(late)))
    row = (await gw.backends())[name_of(late)]
    assert (row["source"], row["draining"], row["healthy"]) == ("pool", False, False)
    assert row["usd_per_hour"] == 10.0
    assert row["runtime"] == "vllm"
    assert row["model"] == "tiny-moe"
    served: set[str] = set()
    while True:  # while it is not ready, every request goes to the ready one
        backend = (await gw.ask())[0]
        if late.ctx.gate.ready():
            break
        served.add(backend)
    assert served == {name_of(ready)}  # (empty only if this machine took 3 s to get here)
    await wait_for(lambda: ready_now(gw, name_of(late)))
    served = {(await gw.ask())[0] for _ in range(6)}
    assert served == {name_of(ready), name_of(late)}  # round robin over both now
    assert late.stats.rejected_not_ready == 0  # never sent a request before its probe passed
    assert name_of(late) in await gw.compared()  # in the live comparison
    assert gw.metric("gateway_discovery_changes_total", source="pool", change="added") == 2


async def ready_now(gw: Gateway, name: str) -> bool:
    row = (await gw.backends()).get(name)
    return row is not None and bool(row["healthy"])


async def listed(gw: Gateway, name: str) -> bool:
    return name in await gw.backends()


async def test_a_backend_that_disappears_drains_its_streams_then_leaves(
    gateway: Callable[..., Any], emulators: Callable[..., Any],
) -> None:
    a, b = await emulators(speed=1.0), await emulators(speed=1.0)  # a 300-token stream lasts about 2 s
    gw: Gateway = await gateway(config_of())
    gw.source.say(found(a, b))
    await wait_for(lambda: both_ready(gw, a, b))
    async with contextlib.AsyncExitStack() as opened:
        streams = [  # round robin: one on each
            await opened.enter_async_context(gw.client.chat.completions.with_streaming_response.create(
                model="moe", messages=[{"role": "user", "content": "go"}], max_tokens=300, stream=True,
                extra_body={"ignore_eos": True}))
            for _ in range(2)
        ]
        (on_b,) = [s for s in streams if s.headers["x-gateway-backend"] == name_of(b)]
        await drain_b_while_its_stream_runs(gw, a, b, on_b)
    await wait_for(lambda: gone(gw, name_of(b)))
    assert name_of(b) not in await gw.compared()  # out of the comparison...
    assert name_of(b) in gw.built.stats.absent  # ...its history kept aside for its return (remember_s)
    assert name_of(b) in proxy_of(gw.built.generations.current).routing.latency  # and its routing memory
    assert gw.metric("gateway_discovery_changes_total", source="pool", change="removed") == 1
    assert gw.metric("gateway_discovery_endpoints", source="pool") == 1


async def drain_b_while_its_stream_runs(gw: Gateway, a: RunningEmulator, b: RunningEmulator, on_b: Any) -> None:
    gw.source.say(found(a))
    await wait_for(lambda: draining(gw, name_of(b)))
    assert (await gw.backends())[name_of(b)]["in_flight"] == 1
    assert {(await gw.ask())[0] for _ in range(4)} == {name_of(a)}  # no new request reaches b
    received = b.stats.requests_received
    row = (await gw.backends())[name_of(b)]
    assert (row["draining"], row["in_flight"]) == (True, 1)  # still here while its stream runs

    finish = [c.choices[0].finish_reason async for c in await on_b.parse() if c.choices]
    assert finish[-1] == "length"  # the in-flight stream ran to its end on b
    assert b.stats.requests_received == received


async def both_ready(gw: Gateway, *emus: RunningEmulator) -> bool:
    rows = await gw.backends()
    return all(rows.get(name_of(e), {}).get("healthy") for e in emus)


async def draining(gw: Gateway, name: str) -> bool:
    row = (await gw.backends()).get(name)
    return row is not None and bool(row["draining"])


async def gone(gw: Gateway, name: str) -> bool:
    return name not in await gw.backends()


async def test_a_backend_that_comes_back_within_remember_s_gets_its_history_and_memory_back(
    gateway: Callable[..., Any], emulators: Callable[..., Any],
) -> None:
    a, b = await emulators(), await emulators()
    gw: Gateway = await gateway(config_of())
    routing = proxy_of(gw.built.generations.current).routing
    gw.source.say(found(a, b))
    await wait_for(lambda: both_ready(gw, a, b))
    served = [(await gw.ask())[0] for _ in range(6)]
    on_b = served.count(name_of(b))
    assert on_b == 3  # round robin
    learned = routing.latency[name_of(b)]
    windows = gw.built.stats.backends[name_of(b)].series
    await wait_for(lambda: counted(gw, name_of(b), on_b))  # the window counts completed seconds

    gw.source.say(found(a))  # b leaves (a pod no longer Ready, a record gone for longer than the hold)...
    await wait_for(lambda: gone(gw, name_of(b)))
    assert name_of(b) not in gw.built.stats.backends
    gw.source.say(found(a, b))  # ...and comes back
    await wait_for(lambda: ready_now(gw, name_of(b)))
    assert gw.built.stats.backends[name_of(b)].series is windows  # its history is back...
    await wait_for(lambda: counted(gw, name_of(b), on_b))  # ...in the comparison
    assert routing.latency[name_of(b)] == learned  # so are its learned rates
    assert gw.metric("gateway_discovery_changes_total", source="pool", change="removed") == 1

    # A reload shortens remember_s; b leaves again and is forgotten once that has passed.
    await gw.reload(config_of(remember_s=0.2))
    gw.source.say(found(a))
    await wait_for(lambda: gone(gw, name_of(b)))
    await until(lambda: name_of(b) not in gw.built.stats.absent and name_of(b) not in routing.latency)
    gw.source.say(found(a, b))
    await wait_for(lambda: ready_now(gw, name_of(b)))
    assert gw.built.stats.backends[name_of(b)].series is not windows  # a newcomer again
    await wait_for(lambda: counted(gw, name_of(b), 0))


async def counted(gw: Gateway, name: str, requests: int) -> bool:
    """`name` is in the live comparison with `requests` requests in the 60-minute window (its
    document is cached per clock second: poll this; a cached one may predate the last change)."""
    body = (await gw.http.get("/admin/compare", params={"window": 3600})).json()
    return {row["name"]: int(row["requests"]) for row in body["backends"]}.get(name) == requests


async def test_a_failing_source_keeps_the_last_backends(
    gateway: Callable[..., Any], emulators: Callable[..., Any],
) -> None:
    a = await emulators()
    gw: Gateway = await gateway(config_of())
    gw.source.say(found(a))
    await wait_for(lambda: ready_now(gw, name_of(a)))
    gw.source.say(Failed("SERVFAIL"))
    gw.source.say(Failed("timeout"))
    await wait_for(lambda: errors_counted(gw, 2))
    assert list(await gw.backends()) == [name_of(a)]
    assert (await gw.ask())[0] == name_of(a)


async def errors_counted(gw: Gateway, count: int) -> bool:
    return gw.metric("gateway_discovery_errors_total", source="pool") >= count


async def test_membership_survives_reloads_and_a_changed_source_restarts(
    gateway: Callable[..., Any], emulators: Callable[..., Any],
) -> None:
    a, b = await emulators(), await emulators()
    gw: Gateway = await gateway(config_of())
    first = gw.source
    first.say(found(a, b))
    await wait_for(lambda: both_ready(gw, a, b))
    await gw.ask()

    await gw.reload(config_of(timeouts={"total_s": 300}))  # the entry as it was: the source goes on
    assert await gw.generation() == 2
    rows = await gw.backends()
    assert {n: (r["source"], r["healthy"]) for n, r in rows.items()} == {
        name_of(a): ("pool", True), name_of(b): ("pool", True)}  # there, and probed, from the first request
    assert gw.sources == [first]
    assert not first.closed

    await gw.reload(config_of(price=20.0))  # only what its backends are: remade, same source
    assert {r["usd_per_hour"] for r in (await gw.backends()).values()} == {20.0}
    assert gw.sources == [first]

    await gw.reload(config_of(price=20.0, host="other.test"))  # another source: restarted
    await until(lambda: len(gw.sources) == 2 and first.closed)
    assert set(await gw.backends()) == {name_of(a), name_of(b)}  # the last set stands until it answers
    gw.source.say(found(a))
    await wait_for(lambda: gone(gw, name_of(b)))
    assert {(await gw.ask())[0] for _ in range(3)} == {name_of(a)}

    await gw.reload({**config_of(), "discovery": [], "backends": [
        {"name": "static", "runtime": "vllm", "url": b.url, "model": "tiny-moe"}],
        "routes": [{"model": "moe", "backends": ["static"]}]})
    await until(lambda: gw.source.closed)  # an entry the config no longer has stops
    assert {n: r["source"] for n, r in (await gw.backends()).items()} == {"static": "static"}


class HeldProbes:
    """A backend whose readiness probes wait until the test lets them answer (200)."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.waiting = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _health(self, request: web.Request) -> web.Response:
        self.waiting += 1
        try:
            await self.open.wait()
        finally:
            self.waiting -= 1
        return web.Response()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        self.open.set()
        if self._runner is not None:
            await self._runner.cleanup()


async def test_a_change_during_a_reload_reaches_the_new_generation(
    gateway: Callable[..., Any], emulators: Callable[..., Any],
) -> None:
    """A reload probes its new pool before installing it; a backend found meanwhile joins it too."""
    a, b = await emulators(), await emulators()
    held = HeldProbes()
    await held.start()
    try:
        config = config_of(backends=[{"name": "held", "runtime": "vllm", "url": held.url, "model": "tiny-moe"}])
        gw: Gateway = await gateway(config)
        gw.source.say(found(a))
        await wait_for(lambda: ready_now(gw, name_of(a)))
        held.open.clear()
        gw.config.write_text(yaml.safe_dump({**config, "timeouts": {"total_s": 300}}))
        reloading = asyncio.create_task(gw.built.reloader.reload())
        await until(lambda: gw.built.membership.newest is not gw.built.generations.current and held.waiting > 0)
        gw.source.say(found(a, b))  # generation 2 is built and being probed, not installed yet
        await until(lambda: name_of(b) in [s.name for s in gw.built.generations.current.pool])
        held.open.set()
        await reloading
        assert await gw.generation() == 2
        await wait_for(lambda: both_ready(gw, a, b))
    finally:
        await held.stop()


async def test_an_arm_may_name_a_pool_and_fails_over_while_it_is_empty(
    gateway: Callable[..., Any], emulators: Callable[..., Any],
) -> None:
    a, static = await emulators(), await emulators()
    config = config_of(backends=[{"name": "static", "runtime": "vllm", "url": static.url, "model": "tiny-moe"}])
    config["routes"] = [{"model": "moe", "split": {"arms": [
        {"name": "discovered", "weight": 1, "backends": ["pool"]},
        {"name": "fixed", "weight": 0, "backends": ["static"]}]}}]
    gw: Gateway = await gateway(config)
    gw.source.say(Resolved(frozenset()))
    await wait_for(lambda: ready_now(gw, "static"))
    assert await gw.ask() == ("static", "fixed")  # the pool has no backend: the arm fails over
    gw.source.say(found(a))
    await wait_for(lambda: ready_now(gw, name_of(a)))
    assert await gw.ask() == (name_of(a), "discovered")
    arms = (await gw.http.get("/admin/compare", params={"window": 60})).json()
    assert next(a for a in arms["arms"] if a["name"] == "discovered")["backends"] == [name_of(a)]
