"""`ExternalProcessor/Process` driven with hand-built messages over a real gRPC socket: the
protocol's corners Envoy will not produce on demand (both body modes, subsets, every error path,
a stream cut mid-answer), against the real gateway (`app.build`) with an emulator as its backend."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import orjson
import pytest
from aiohttp import web
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.base import Runtime
from backends.emulator import EmulatorConfig, start_emulator
from gateway.app import build
from gateway.picker import wire
from gateway.picker.proto import ext_proc_pb2 as pb
from gateway.picker.server import SERVICE, PickerServer
from gateway.settings import parse_settings
from tests.polling import until

KEY = "sk-test-1"
CHAT = {"model": "moe", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}


def headers(path: str = "/v1/chat/completions", **extra: str) -> pb.HttpHeaders:
    values = {":method": "POST", ":path": path, ":authority": "gw", "content-type": "application/json", **extra}
    return pb.HttpHeaders(headers=pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode())
                                                        for k, v in values.items()]))


def first(head: pb.HttpHeaders, mode: int = wire.FULL_DUPLEX_STREAMED,
          subset: str | list[str] | None = None) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest(request_headers=head, protocol_config=pb.ProtocolConfiguration(
        request_body_mode=mode, response_body_mode=mode))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({wire.SUBSET: subset if isinstance(subset, str) else list(subset)})
        message.metadata_context.filter_metadata[wire.SUBSET_NAMESPACE].CopyFrom(hint)
    return message


def body(data: bytes, *, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def response_head(status: int, *, upstream: bool = True) -> pb.ProcessingRequest:
    values = {":status": str(status), "content-type": "application/json"}
    if upstream:
        values["x-envoy-upstream-service-time"] = "3"
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=pb.HeaderMap(
        headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()])))


def response_body(data: bytes, *, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


def chunk(text: str) -> bytes:
    delta = {"id": "c", "object": "chat.completion.chunk", "model": "moe",
             "choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + orjson.dumps(delta) + b"\n\n"


def set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


@dataclass
class Picker:
    channel: grpc.aio.Channel
    registry: CollectorRegistry
    endpoints: list[str]  # the backends' ip:port, in config order
    port: int

    def open(self) -> grpc.aio.StreamStreamCall[pb.ProcessingRequest, pb.ProcessingResponse]:
        method = self.channel.stream_stream(
            f"/{SERVICE}/Process", request_serializer=pb.ProcessingRequest.SerializeToString,
            response_deserializer=pb.ProcessingResponse.FromString)
        return method()  # type: ignore[return-value]  # (grpc's stubs type the request as Message)

    def samples(self, name: str, **labels: str) -> float:
        total = 0.0
        for family in text_string_to_metric_families(generate_latest(self.registry).decode()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


async def routed(picker: Picker, request: dict[str, Any], **extra: str) -> tuple[
        grpc.aio.StreamStreamCall[pb.ProcessingRequest, pb.ProcessingResponse], pb.ProcessingResponse]:
    call = picker.open()
    await call.write(first(headers(**extra)))
    await call.write(body(orjson.dumps(request)))
    answer = await call.read()
    assert isinstance(answer, pb.ProcessingResponse)
    return call, answer


@pytest.fixture
async def picker() -> AsyncIterator[Picker]:
    emus = [await start_emulator(EmulatorConfig(runtime=Runtime.VLLM, model="moe", profile="tiny", speed=50.0),
                                 host="127.0.0.1", port=0) for _ in range(2)]
    settings = parse_settings({
        "backends": [{"name": f"v{i}", "runtime": "vllm", "url": e.url, "model": "moe"} for i, e in enumerate(emus)],
        "routes": [{"model": "moe", "backends": ["v0", "v1"], "policy": "prefix_affinity"}],
        "auth": {"api_keys": [{"id": "team", "key": "sha256:" + hashlib.sha256(KEY.encode()).hexdigest(),
                               "requests_per_minute": 1000},
                              {"id": "slow", "key": "sha256:" + hashlib.sha256(b"sk-slow").hexdigest(),
                               "requests_per_minute": 1}]},
    })
    registry = CollectorRegistry()
    built = await build(settings, registry=registry)
    runner = web.AppRunner(built.app)
    await runner.setup()
    server = PickerServer(built.picking, lambda: bool(built.generations.current.pool.healthy_names()),
                          max_body_bytes=4096)
    port = await server.start("127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Picker(channel, registry, [e.url.removeprefix("http://") for e in emus], port)
    finally:
        await channel.close()
        await server.stop(1)
        await runner.cleanup()
        for e in emus:
            await e.stop()


AUTH = {"authorization": f"Bearer {KEY}"}


async def test_full_duplex_routes_on_the_headers_answer_and_streams_the_body_back(picker: Picker) -> None:
    call, answer = await routed(picker, CHAT, **AUTH)
    assert answer.WhichOneof("response") == "request_headers"
    common = answer.request_headers.response
    chosen = set_headers(common.header_mutation)[wire.DESTINATION]
    assert chosen in picker.endpoints
    assert common.clear_route_cache
    assert "authorization" in common.header_mutation.remove_headers  # the gateway's key stays here
    lb = answer.dynamic_metadata.fields[wire.LB_NAMESPACE].struct_value.fields[wire.DESTINATION].string_value
    assert lb == chosen
    echoed = await call.read()
    assert isinstance(echoed, pb.ProcessingResponse)
    streamed = echoed.request_body.response.body_mutation.streamed_response
    assert orjson.loads(streamed.body) == CHAT
    assert streamed.end_of_stream
    # the answer passes back unchanged, with the gateway's headers added
    await call.write(response_head(200))
    head = await call.read()
    assert isinstance(head, pb.ProcessingResponse)
    assert set_headers(head.response_headers.response.header_mutation)["x-gateway-backend"] in {"v0", "v1"}
    reply = orjson.dumps({"id": "x", "object": "chat.completion", "model": "moe", "choices": [],
                          "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}})
    await call.write(response_body(reply[:10], end=False))
    await call.write(response_body(reply[10:], end=True))
    chunks = [await call.read(), await call.read()]
    assert b"".join(c.response_body.response.body_mutation.streamed_response.body for c in chunks
                    if isinstance(c, pb.ProcessingResponse)) == reply
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert picker.samples("gateway_requests_total", status="200") == 1
    assert picker.samples("gateway_tokens_total", kind="prompt") == 7
    assert picker.samples("gateway_tokens_total", kind="completion") == 5
    assert picker.samples("gateway_key_tokens_total", key="team") == 12


async def test_prefix_affinity_sends_one_prompt_to_one_backend(picker: Picker) -> None:
    # a prompt of several blocks: one shorter than a block has no prefix to follow, and goes to the
    # least loaded (which a pick not yet released in the picker made the other backend, now and then)
    long = {**CHAT, "messages": [{"role": "user", "content": "hello there, " * 40}]}
    seen = set()
    for _ in range(6):
        call, answer = await routed(picker, long, **AUTH)
        seen.add(set_headers(answer.request_headers.response.header_mutation)[wire.DESTINATION])
        call.cancel()
    assert len(seen) == 1
    assert picker.samples("gateway_routing_decisions_total", reason="hash") == 1
    assert picker.samples("gateway_routing_decisions_total", reason="affinity") == 5


async def test_buffered_mode_answers_the_headers_at_once_and_routes_on_the_body(picker: Picker) -> None:
    call = picker.open()
    await call.write(first(headers(**AUTH), mode=wire.BUFFERED))
    answer = await call.read()
    assert isinstance(answer, pb.ProcessingResponse)
    assert answer.WhichOneof("response") == "request_headers"
    assert not answer.request_headers.response.header_mutation.set_headers
    await call.write(body(orjson.dumps(CHAT)))
    routed_body = await call.read()
    assert isinstance(routed_body, pb.ProcessingResponse)
    common = routed_body.request_body.response
    assert set_headers(common.header_mutation)[wire.DESTINATION] in picker.endpoints
    assert common.clear_route_cache
    assert not common.HasField("body_mutation")  # the body goes on unchanged
    call.cancel()


@pytest.mark.parametrize("as_string", [False, True])
async def test_a_subset_hint_is_obeyed(picker: Picker, as_string: bool) -> None:
    only = picker.endpoints[1]
    for n in range(4):
        call = picker.open()
        await call.write(first(headers(**AUTH), subset=only if as_string else [only]))
        await call.write(body(orjson.dumps({**CHAT, "messages": [{"role": "user", "content": f"p{n}"}]})))
        answer = await call.read()
        assert isinstance(answer, pb.ProcessingResponse)
        assert set_headers(answer.request_headers.response.header_mutation)[wire.DESTINATION] == only
        call.cancel()


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:80"]])
async def test_an_empty_or_foreign_subset_is_a_503_never_fail_open(picker: Picker, subset: list[str]) -> None:
    call = picker.open()
    await call.write(first(headers(**AUTH), subset=subset))
    await call.write(body(orjson.dumps(CHAT)))
    answer = await call.read()
    assert isinstance(answer, pb.ProcessingResponse)
    immediate = answer.immediate_response
    assert immediate.status.code == 503
    assert orjson.loads(immediate.body)["error"]["type"]
    assert await call.read() == grpc.aio.EOF
    assert picker.samples("gateway_requests_total", status="503") == 1


@pytest.mark.parametrize(("path", "payload", "key", "status", "kind"), [
    ("/v1/chat/completions", orjson.dumps({**CHAT, "model": "nope"}), KEY, 404, "invalid_request_error"),
    ("/v1/chat/completions", b"{not json", KEY, 400, "invalid_request_error"),
    ("/v1/chat/completions", orjson.dumps({"model": "moe"}), KEY, 400, "invalid_request_error"),
    ("/v1/nothing", orjson.dumps(CHAT), KEY, 404, "invalid_request_error"),
    ("/v1/chat/completions", orjson.dumps(CHAT), "sk-wrong", 401, "invalid_request_error"),
    ("/v1/chat/completions", b"x" * 5000, KEY, 413, "invalid_request_error"),
])
async def test_errors_are_openai_shaped_immediate_responses(
    picker: Picker, path: str, payload: bytes, key: str, status: int, kind: str
) -> None:
    call = picker.open()
    await call.write(first(headers(path, authorization=f"Bearer {key}")))
    await call.write(body(payload))
    answer = await call.read()
    assert isinstance(answer, pb.ProcessingResponse)
    immediate = answer.immediate_response
    assert immediate.status.code == status
    error = orjson.loads(immediate.body)["error"]
    assert error["type"] == kind
    assert error["message"]
    assert set_headers(immediate.headers)["content-type"] == "application/json"


async def test_a_spent_rate_limit_is_a_429_with_retry_after(picker: Picker) -> None:
    slow = {"authorization": "Bearer sk-slow"}
    call, answer = await routed(picker, CHAT, **slow)
    assert answer.WhichOneof("response") == "request_headers"
    call.cancel()
    call, answer = await routed(picker, CHAT, **slow)
    immediate = answer.immediate_response
    assert immediate.status.code == 429
    assert orjson.loads(immediate.body)["error"]["code"] == "rate_limit_exceeded"
    assert int(set_headers(immediate.headers)["retry-after"]) >= 1
    assert picker.samples("gateway_requests_total", status="429") == 1


async def test_a_stream_is_measured_and_a_cut_is_client_closed_once(picker: Picker) -> None:
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    call, _ = await routed(picker, stream, **AUTH)
    await call.read()
    await call.write(response_head(200))
    await call.read()
    event = chunk("hi")
    await call.write(response_body(event, end=False))
    await call.read()
    call.cancel()  # Envoy resets the stream: the client left

    await until(lambda: picker.samples("gateway_requests_total", status="client_closed") == 1, within_s=5)
    assert picker.samples("gateway_requests_total") == 1


async def test_a_full_stream_is_a_200_with_the_engines_usage(picker: Picker) -> None:
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    call, _ = await routed(picker, stream, **AUTH)
    await call.read()
    await call.write(response_head(200))
    await call.read()
    events = b"".join([
        chunk("a"), chunk("b"),
        b'data: {"id":"c","object":"chat.completion.chunk","model":"moe","choices":[],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n',
        b"data: [DONE]\n\n"])
    await call.write(response_body(events, end=True))
    echoed = await call.read()
    assert isinstance(echoed, pb.ProcessingResponse)
    assert echoed.response_body.response.body_mutation.streamed_response.body == events
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert picker.samples("gateway_requests_total", status="200") == 1
    assert picker.samples("gateway_tokens_total", kind="completion") == 2
    assert picker.samples("gateway_time_to_first_token_seconds_count") == 1


async def test_an_engine_500_is_recorded_with_its_status(picker: Picker) -> None:
    call, _ = await routed(picker, CHAT, **AUTH)
    await call.read()
    await call.write(response_head(500))
    await call.read()
    await call.write(response_body(b'{"error":{"message":"boom"}}', end=True))
    await call.read()
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert picker.samples("gateway_requests_total", status="500") == 1


async def test_health_reports_serving(picker: Picker) -> None:
    stub = health_pb2_grpc.HealthStub(picker.channel)
    for service in ("", SERVICE):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
