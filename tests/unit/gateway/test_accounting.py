"""The dispatcher records every request exactly once, from its `finally`, whatever ended it.

The real gateway (`app.build`) in front of an emulator on a loopback socket; what varies is the
response sink, which fails the way a broken client connection or a bug would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import orjson
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.base import Endpoint, Runtime
from backends.emulator import EmulatorConfig, start_emulator
from gateway.app import Built, build
from gateway.errors import InvalidRequest
from gateway.settings import parse_settings


@dataclass
class Sink:
    """A response sink that fails at a chosen step (`fail_on`) with a chosen exception."""

    fail_on: str = ""
    error: BaseException = field(default_factory=lambda: RuntimeError("bug"))
    after_writes: int = 0
    writes: int = 0

    def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        if self.fail_on == "send":
            raise self.error

    async def start(self, status: int, headers: Mapping[str, str], first: bytes = b"") -> None:
        if self.fail_on == "start":
            raise self.error

    async def send_stream(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        await self.start(status, headers, body)
        await self.end()

    async def write(self, data: bytes) -> None:
        self.push(data)

    def push(self, data: bytes) -> bool:
        self.writes += 1
        if self.fail_on == "write" and self.writes > self.after_writes:
            raise self.error
        return False

    async def flush(self) -> None:
        pass

    async def end(self) -> None:
        if self.fail_on == "end":
            raise self.error


@dataclass
class Gateway:
    built: Built
    registry: CollectorRegistry

    async def ask(self, sink: Sink, *, stream: bool, body: dict[str, object] | None = None) -> BaseException | None:
        request = body or {"model": "moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                           "stream": stream}
        try:
            await self.built.dispatcher.dispatch({}, orjson.dumps(request), Endpoint.CHAT, sink, "rid")
        except BaseException as exc:
            return exc
        return None

    def samples(self, name: str) -> dict[str, float]:
        """`status` (or `kind`) -> value of the samples called `name`."""
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(generate_latest(self.registry).decode()):
            for s in family.samples:
                if s.name == name:
                    key = s.labels.get("status") or s.labels.get("kind") or ""
                    out[key] = out.get(key, 0.0) + s.value
        return out


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    emu = await start_emulator(EmulatorConfig(runtime=Runtime.VLLM, model="tiny-moe", profile="tiny", speed=5.0),
                               host="127.0.0.1", port=0)
    settings = parse_settings({
        "backends": [{"name": "v", "runtime": "vllm", "url": emu.url, "model": "tiny-moe"}],
        "routes": [{"model": "moe", "backends": ["v"]}],
    })
    registry = CollectorRegistry()
    built = await build(settings, registry=registry)
    runner = web.AppRunner(built.app)  # runs the app's lifetime (health poller, clean-up)
    await runner.setup()
    try:
        yield Gateway(built, registry)
    finally:
        await runner.cleanup()
        await emu.stop()


async def test_a_bug_after_a_stream_started_is_a_stream_error_not_a_200(gateway: Gateway) -> None:
    failure = await gateway.ask(Sink("write"), stream=True)
    assert isinstance(failure, RuntimeError)
    assert gateway.samples("gateway_requests_total") == {"stream_error": 1.0}


async def test_a_bug_before_any_response_is_a_500(gateway: Gateway) -> None:
    failure = await gateway.ask(Sink("send"), stream=False)
    assert isinstance(failure, RuntimeError)
    assert gateway.samples("gateway_requests_total") == {"500": 1.0}


async def test_gateway_errors_are_recorded_with_their_status(gateway: Gateway) -> None:
    failure = await gateway.ask(Sink(), stream=False, body={"model": "moe"})
    assert isinstance(failure, InvalidRequest)
    assert gateway.samples("gateway_requests_total") == {"400": 1.0}


@pytest.mark.parametrize(("fail_on", "expected"), [("start", "client_closed"), ("end", "200")])
async def test_a_client_leaving_is_client_closed_unless_it_had_read_to_done(
    gateway: Gateway, fail_on: str, expected: str
) -> None:
    failure = await gateway.ask(Sink(fail_on, asyncio.CancelledError()), stream=True)
    assert isinstance(failure, asyncio.CancelledError)
    assert gateway.samples("gateway_requests_total") == {expected: 1.0}


async def test_a_stream_cut_before_its_usage_is_charged_the_estimate(gateway: Gateway) -> None:
    body = {"model": "moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    await gateway.ask(Sink("write", ConnectionResetError("gone"), after_writes=3), stream=True, body=body)
    assert gateway.samples("gateway_requests_total") == {"client_closed": 1.0}
    tokens = gateway.samples("gateway_tokens_total")
    assert tokens["prompt"] > 0  # the prompt estimate
    assert 1 <= tokens["completion"] < 200  # the token events the relay saw before the client left


async def test_refused_requests_are_recorded_once(gateway: Gateway) -> None:
    gateway.built.dispatcher.refused(Endpoint.CHAT, 413, None)
    assert gateway.samples("gateway_requests_total") == {"413": 1.0}
