"""The dispatcher records every request exactly once, from its `finally`, whatever ended it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from backends.base import Endpoint
from gateway.access.auth import Guard
from gateway.access.ratelimit import KeyLimiter
from gateway.errors import InvalidRequest
from gateway.observability.metrics import Recorder
from gateway.observability.outcome import Gaps, Outcome
from gateway.proxy.accounting import Accounting
from gateway.proxy.dispatch import Dispatcher
from gateway.proxy.exchange import Exchange
from gateway.proxy.sink import ResponseSink
from gateway.proxy.sse import StreamStats
from gateway.routing import RoutingState
from gateway.state.generations import Generations
from gateway.state.pool import Pool

Serve = Callable[[Exchange], Awaitable[None]]


@dataclass
class FakeProxy:
    serve_with: Serve

    def parse(self, ex: Exchange, body: bytes, headers: Mapping[str, str]) -> None:
        ex.model = "m"

    async def serve(self, ex: Exchange, headers: Mapping[str, str], sink: ResponseSink) -> None:
        await self.serve_with(ex)


@dataclass
class FakeSecrets:
    api_keys: tuple[Any, ...] = ()
    admin_digest: str | None = None


@dataclass
class FakeGeneration:
    proxy: FakeProxy
    secrets: FakeSecrets = field(default_factory=FakeSecrets)


class FakeGenerations:
    def __init__(self, proxy: FakeProxy) -> None:
        self.current = FakeGeneration(proxy)
        self.entered = 0

    def enter(self) -> FakeGeneration:
        self.entered += 1
        return self.current

    def leave(self, generation: FakeGeneration) -> None:
        self.entered -= 1


class NullSink:
    def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None: ...

    async def start(self, status: int, headers: Mapping[str, str], first: bytes = b"") -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...


def dispatcher(serve: Serve) -> tuple[Dispatcher, list[Outcome], FakeGenerations]:
    recorded: list[Outcome] = []
    generations = FakeGenerations(FakeProxy(serve))
    registry = CollectorRegistry()
    recorder = Recorder(registry, Pool([]), observers=[recorded.append])
    as_generations = cast(Generations, generations)
    accounting = Accounting(recorder, RoutingState(), clock=lambda: 1.0)
    guard = Guard(as_generations, KeyLimiter(lambda: 0.0), registry)
    return Dispatcher(as_generations, guard, accounting, clock=lambda: 0.0), recorded, generations


async def run(serve: Serve) -> tuple[list[Outcome], BaseException | None]:
    d, recorded, generations = dispatcher(serve)
    failure: BaseException | None = None
    try:
        await d.dispatch({}, b"{}", Endpoint.CHAT, NullSink(), "rid")
    except BaseException as exc:
        failure = exc
    assert generations.entered == 0  # the generation is left whatever happened
    return recorded, failure


def stream_stats() -> StreamStats:
    return StreamStats(Gaps(random.Random(0)))


async def test_a_bug_after_a_stream_started_is_a_stream_error_not_a_200() -> None:
    async def serve(ex: Exchange) -> None:
        ex.status, ex.stream = "200", stream_stats()
        raise RuntimeError("bug")

    recorded, failure = await run(serve)
    assert isinstance(failure, RuntimeError)
    assert [o.status for o in recorded] == ["stream_error"]


async def test_a_bug_before_any_response_is_a_500() -> None:
    async def serve(ex: Exchange) -> None:
        ex.status = "200"  # set before the body was sent, then the sending failed
        raise RuntimeError("bug")

    recorded, _ = await run(serve)
    assert [o.status for o in recorded] == ["500"]


async def test_gateway_errors_are_recorded_with_their_status() -> None:
    async def serve(ex: Exchange) -> None:
        raise InvalidRequest("no")

    recorded, failure = await run(serve)
    assert isinstance(failure, InvalidRequest)
    assert [o.status for o in recorded] == ["400"]


@pytest.mark.parametrize(("done", "expected"), [(False, "client_closed"), (True, "200")])
async def test_a_client_leaving_is_client_closed_unless_it_had_read_to_done(done: bool, expected: str) -> None:
    async def serve(ex: Exchange) -> None:
        ex.status, ex.stream = "200", stream_stats()
        ex.stream.done = done
        raise asyncio.CancelledError

    recorded, failure = await run(serve)
    assert isinstance(failure, asyncio.CancelledError)
    assert [o.status for o in recorded] == [expected]


async def test_a_request_that_reached_an_engine_without_usage_is_charged_the_estimate() -> None:
    from gateway.routing import RequestFeatures

    async def serve(ex: Exchange) -> None:
        ex.features = RequestFeatures(prompt_tokens=42)
        ex.engine_worked = True
        ex.status, ex.stream = "200", stream_stats()
        ex.stream.tokens = 7
        raise asyncio.CancelledError

    recorded, _ = await run(serve)
    (outcome,) = recorded
    assert outcome.usage is not None
    assert (outcome.usage.prompt_tokens, outcome.usage.completion_tokens) == (42, 7)
    assert outcome.usage_estimated


async def test_refused_requests_are_recorded_once() -> None:
    d, recorded, _ = dispatcher(lambda ex: asyncio.sleep(0))
    d.refused(Endpoint.CHAT, 413, None)
    assert [(o.status, o.backend, o.model) for o in recorded] == [("413", "none", "none")]
