"""An OTLP trace receiver for the tests: opentelemetry-proto's collector `TraceService` on `grpc.aio`,
and the OTLP/HTTP protobuf endpoint (`POST /v1/traces`) on aiohttp, both on loopback, both keeping
every span they are sent (decoded from the protobuf the exporters sent, nothing of ours in between).

It runs its own event loop in a daemon thread, so sync tests (and a session fixture of the real-vLLM
tier) can start it, point gateways and engines at it, and read what arrived. With `failing = True` it
answers every export with an error (UNAVAILABLE, 503): what a collector that is down looks like.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

T = TypeVar("T")
KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return None if which is None else getattr(v, which)


def _attributes(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class Span:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL...
    attributes: dict[str, Any]
    status: str  # UNSET, OK, ERROR
    start_ns: int
    end_ns: int
    resource: dict[str, Any]
    trace_flags: int
    via: str  # grpc | http

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def decode(resource_spans: Iterable[ResourceSpans], via: str) -> list[Span]:
    out = []
    for rs in resource_spans:
        resource = _attributes(rs.resource.attributes)
        for scope in rs.scope_spans:
            for s in scope.spans:
                out.append(Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                                KINDS.get(s.kind, str(s.kind)), _attributes(s.attributes),
                                STATUS.get(s.status.code, str(s.status.code)), s.start_time_unix_nano,
                                s.end_time_unix_nano, resource, s.flags, via))
    return out


class Receiver:
    """Both OTLP endpoints on loopback; `spans` is everything received so far (thread-safe reads)."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self.failing = False
        self.exports = 0  # export requests answered (either way)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="otlp-receiver", daemon=True)
        self._thread.start()
        self._grpc: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self.grpc_port, self.http_port = self._run(self._start())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/traces"

    def _keep(self, spans: list[Span]) -> None:
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1

    async def _start(self) -> tuple[int, int]:
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            async def Export(
                self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext[Any, Any],
            ) -> trace_service_pb2.ExportTraceServiceResponse:
                if receiver.failing:
                    receiver._keep([])
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the test collector is failing")
                receiver._keep(decode(request.resource_spans, "grpc"))
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)  # type: ignore[no-untyped-call]
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._grpc = server

        async def export(request: web.Request) -> web.Response:
            if self.failing:
                self._keep([])
                return web.Response(status=503)
            message = trace_service_pb2.ExportTraceServiceRequest()
            message.ParseFromString(await request.read())
            self._keep(decode(message.resource_spans, "http"))
            return web.Response(body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                                content_type="application/x-protobuf")

        app = web.Application()
        app.router.add_post("/v1/traces", export)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner = runner
        return grpc_port, int(runner.addresses[0][1])

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, ok: Callable[[list[Span]], bool], *, timeout: float = 30.0, what: str = "spans",
                 trace_id: str | None = None) -> list[Span]:
        """Poll until `ok(spans)` holds (of one trace, when given); fail showing what did arrive."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.trace(trace_id) if trace_id is not None else self.spans
            if ok(got):
                return got
            if time.monotonic() > deadline:
                names = [(s.name, s.kind, s.parent_span_id) for s in got]
                raise AssertionError(f"timed out after {timeout} s waiting for {what}; got {names}")
            time.sleep(0.05)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def stop(self) -> None:
        async def down() -> None:
            if self._grpc is not None:
                await self._grpc.stop(0)
            if self._runner is not None:
                await self._runner.cleanup()

        self._run(down())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()
