"""Traces, end to end: a real `gateway serve` exporting to a real OTLP receiver (tests/otlp.py: the
collector's gRPC service and the HTTP/protobuf endpoint), emulators and a header-recording backend
behind it. What a trace backend would show: the request's span continuing the client's
`traceparent`, its routing and attempt children (retries as siblings, errors typed), the
`traceparent` each attempt sent the engine, sampling, exemplars on /metrics, and a collector that
is down costing requests nothing."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from tests.otlp import Receiver, Span

from .fakes import RecordingBackend, start_recording_backend
from .harness import Emulators, GatewayProcess, LoopThread, backend_entry, eventually

StartGateway = Callable[..., GatewayProcess]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # spans reach the receiver within a tenth of a second
CHAT = {"model": "moe", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rx = Receiver()
    yield rx
    rx.stop()


@pytest.fixture
def recording(loop_thread: LoopThread) -> Iterator[RecordingBackend]:
    backend = loop_thread.run(start_recording_backend())
    yield backend
    loop_thread.run(backend.runner.cleanup())


def tracing(rx: Receiver, **extra: Any) -> dict[str, Any]:
    return {"otlp_endpoint": rx.grpc_endpoint, **extra}


def post(gw: GatewayProcess, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def by_kind(spans: list[Span], kind: str) -> list[Span]:
    return [s for s in spans if s.kind == kind]


def one(spans: list[Span], kind: str) -> Span:
    found = by_kind(spans, kind)
    assert len(found) == 1, [(s.name, s.kind) for s in spans]
    return found[0]


def test_a_streamed_request_is_a_server_span_continuing_the_client_with_route_and_attempt_children(
    emulators: Emulators, gateway: StartGateway, receiver: Receiver,
) -> None:
    emu = emulators.start("vllm")
    gw = gateway([backend_entry("a", emu, "vllm", usd_per_hour=3.0)], env=FAST_EXPORT, tracing=tracing(receiver))
    resp = post(gw, {**CHAT, "stream": True, "temperature": 0.5},
                traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", tracestate="vendor=blue")
    assert resp.status_code == 200
    assert resp.headers["x-trace-id"] == CLIENT_TRACE
    spans = receiver.wait_for(lambda s: len(s) >= 3, trace_id=CLIENT_TRACE, what="server, route and attempt spans")
    server, route, attempt = one(spans, "SERVER"), one(spans, "INTERNAL"), one(spans, "CLIENT")
    assert server.parent_span_id == CLIENT_SPAN  # the client's span is its parent: one trace
    assert server.name == "chat moe"  # {gen_ai.operation.name} {gen_ai.request.model}
    assert route.parent_span_id == attempt.parent_span_id == server.span_id
    a = server.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "moe"
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.response.model"] == "tiny-moe"
    assert a["gen_ai.provider.name"] == "vllm"
    assert a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < a["gen_ai.response.time_to_first_chunk"] <= server.duration_s
    assert a["gateway.backend"] == "a"
    assert a["gateway.retries"] == 0
    assert a["gateway.backend.usd_per_hour"] == 3.0
    assert a["http.response.status_code"] == 200
    assert "error.type" not in a
    assert route.attributes["gateway.routing.policy"] == "round_robin"
    assert route.attributes["gateway.routing.candidates"] == ["a"]
    assert route.attributes["gateway.routing.chosen"] == "a"
    assert attempt.name == "chat tiny-moe"
    port = int(emu.url.rsplit(":", 1)[1])
    assert attempt.attributes["server.address"] == "127.0.0.1"
    assert attempt.attributes["server.port"] == port
    assert attempt.attributes["gateway.attempt"] == 1
    assert server.service == "inference-gateway"
    assert server.via == "grpc"
    assert server.start_ns <= route.start_ns <= attempt.start_ns <= attempt.end_ns <= server.end_ns


def test_every_attempt_sends_traceparent_of_its_own_span_and_the_client_tracestate(
    recording: RecordingBackend, gateway: StartGateway, receiver: Receiver,
) -> None:
    gw = gateway([{"name": "r", "runtime": "vllm", "url": recording.url, "model": "tiny-moe"}], env=FAST_EXPORT,
                 tracing=tracing(receiver))
    resp = post(gw, CHAT, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", tracestate="vendor=blue")
    assert resp.status_code == 200
    attempt = one(receiver.wait_for(lambda s: bool(by_kind(s, "CLIENT")), trace_id=CLIENT_TRACE), "CLIENT")
    sent = recording.headers[-1]
    assert sent["traceparent"] == f"00-{CLIENT_TRACE}-{attempt.span_id}-01"  # the engine's span joins as its child
    assert sent["tracestate"] == "vendor=blue"
    # a request without a traceparent starts a trace of its own, and still passes one upstream
    resp = post(gw, CHAT)
    own = resp.headers["x-trace-id"]
    assert len(own) == 32
    assert own != CLIENT_TRACE
    attempt = one(receiver.wait_for(lambda s: bool(by_kind(s, "CLIENT")), trace_id=own), "CLIENT")
    assert recording.headers[-1]["traceparent"] == f"00-{own}-{attempt.span_id}-01"
    server = one(receiver.trace(own), "SERVER")
    assert server.parent_span_id == ""


def test_retries_are_sibling_attempts_and_the_failed_one_says_why(
    emulators: Emulators, gateway: StartGateway, receiver: Receiver,
) -> None:
    sick = emulators.start("vllm", fail_first=1000, fail_status=503)
    ok = emulators.start("sglang")
    gw = gateway([backend_entry("sick", sick, "vllm"), backend_entry("ok", ok, "sglang")], env=FAST_EXPORT,
                 tracing=tracing(receiver))
    for _ in range(6):  # round robin: one of the first two starts on the sick backend
        resp = post(gw, CHAT)
        assert resp.status_code == 200
        spans = receiver.wait_for(lambda s: any(x.kind == "SERVER" for x in s), trace_id=resp.headers["x-trace-id"])
        if len(by_kind(spans, "CLIENT")) == 2:
            break
    else:
        pytest.fail("no request was retried")
    server = one(spans, "SERVER")
    first, second = sorted(by_kind(spans, "CLIENT"), key=lambda s: s.attributes["gateway.attempt"])
    assert first.parent_span_id == second.parent_span_id == server.span_id  # siblings, not nested
    assert first.attributes["gateway.backend"] == "sick"
    assert first.attributes["error.type"] == "503"
    assert first.status == "ERROR"
    assert first.end_ns <= second.start_ns
    assert second.attributes["gateway.backend"] == "ok"
    assert "error.type" not in second.attributes
    assert second.attributes["gen_ai.provider.name"] == "sglang"
    assert server.attributes["gateway.retries"] == 1
    assert server.attributes["gateway.backend"] == "ok"
    assert len(by_kind(spans, "INTERNAL")) == 2  # a routing decision per attempt


def test_a_failed_request_is_an_error_span_and_its_answer_names_the_trace(
    emulators: Emulators, gateway: StartGateway, receiver: Receiver,
) -> None:
    broken = emulators.start("vllm", fail_first=1000, fail_status=500)
    gw = gateway([backend_entry("broken", broken, "vllm")], env=FAST_EXPORT, tracing=tracing(receiver))
    resp = post(gw, CHAT)
    assert resp.status_code == 500
    assert resp.json()["error"]["message"]
    trace_id = resp.headers["x-trace-id"]  # errors say their trace too
    spans = receiver.wait_for(lambda s: len(s) >= 3, trace_id=trace_id)
    server, attempt = one(spans, "SERVER"), one(spans, "CLIENT")
    assert attempt.attributes["error.type"] == "500"
    assert attempt.status == "ERROR"
    assert server.attributes["error.type"] == "500"
    assert server.status == "ERROR"
    # the client's own mistake is typed on the span but is not the gateway's error
    resp = post(gw, {**CHAT, "model": "nope"})
    assert resp.status_code == 404
    server = one(receiver.wait_for(lambda s: bool(s), trace_id=resp.headers["x-trace-id"]), "SERVER")
    assert server.attributes["error.type"] == "404"
    assert server.status == "UNSET"
    assert server.name == "chat"


def test_sampling_follows_the_ratio_and_the_callers_decision(
    recording: RecordingBackend, gateway: StartGateway, receiver: Receiver,
) -> None:
    gw = gateway([{"name": "r", "runtime": "vllm", "url": recording.url, "model": "tiny-moe"}], env=FAST_EXPORT,
                 tracing=tracing(receiver, sample_ratio=0.0))
    unsampled = [post(gw, CHAT) for _ in range(5)]
    caller_off = post(gw, CHAT, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00")
    assert recording.headers[-1]["traceparent"] == f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"  # passed on, not sampled
    caller_on = post(gw, CHAT, traceparent=f"00-{'1' * 32}-{CLIENT_SPAN}-01")  # parent-based: the caller decides
    receiver.wait_for(lambda s: len(s) >= 3, trace_id="1" * 32)
    ids = {r.headers["x-trace-id"] for r in [*unsampled, caller_off]}
    assert len(ids) == 6
    assert all(len(i) == 32 for i in ids)
    assert {s.trace_id for s in receiver.spans} == {"1" * 32}  # ... but only the sampled one was recorded
    assert caller_on.status_code == 200
    assert recording.headers[0]["traceparent"].endswith("-00")
    # an OTEL variable wins over the config: the SDK's standard sampler names
    gw2 = gateway([{"name": "r", "runtime": "vllm", "url": recording.url, "model": "tiny-moe"}],
                  env={**FAST_EXPORT, "OTEL_TRACES_SAMPLER": "always_on"}, tracing=tracing(receiver, sample_ratio=0.0))
    forced = post(gw2, CHAT, traceparent=f"00-{'2' * 32}-{CLIENT_SPAN}-00")  # always_on ignores the caller
    receiver.wait_for(lambda s: len(s) >= 3, trace_id=forced.headers["x-trace-id"])


def test_an_unreachable_collector_costs_requests_nothing_and_its_drops_are_counted(
    emulators: Emulators, gateway: StartGateway, receiver: Receiver,
) -> None:
    emu = emulators.start("vllm", speed=1000.0)
    receiver.failing = True  # answers every export UNAVAILABLE: down
    env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TIMEOUT": "6", "OTEL_BSP_MAX_QUEUE_SIZE": "8"}
    gw = gateway([backend_entry("a", emu, "vllm")], env=env, tracing=tracing(receiver))
    took = []
    for _ in range(40):
        started = time.monotonic()
        assert post(gw, CHAT).status_code == 200
        took.append(time.monotonic() - started)
    # an export that waited on the collector would hold a request for its retries, up to the export
    # timeout (6 s); half of it leaves room for a loaded machine's scheduling (a request takes ~0.1 s)
    assert max(took) < 3.0, took
    eventually(lambda: gw.metric("gateway_tracing_spans_dropped_total", reason="export_failed") > 0, timeout=30)
    assert gw.metric("gateway_tracing_spans_dropped_total", reason="queue_full") > 0  # 120 spans, 8 fit
    assert receiver.exports > 0
    assert receiver.spans == []
    assert gw.metric("gateway_requests_total", status="200") == 40
    receiver.failing = False  # back up: what waits in the queue goes, and what comes after it
    eventually(lambda: gw.metric("gateway_tracing_spans_exported_total") > 0, timeout=30)
    trace_id = post(gw, CHAT).headers["x-trace-id"]
    receiver.wait_for(lambda s: len(s) >= 3, trace_id=trace_id, timeout=30)


def test_a_collector_that_is_not_there_at_all_leaves_requests_as_they_were(
    emulators: Emulators, gateway: StartGateway,
) -> None:
    emu = emulators.start("vllm", speed=1000.0)
    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    gw = gateway([backend_entry("a", emu, "vllm")], env={**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TIMEOUT": "2"},
                 tracing={"otlp_endpoint": dead})
    started = time.monotonic()
    for _ in range(20):
        assert post(gw, {**CHAT, "stream": True}).status_code == 200
    assert time.monotonic() - started < 10
    eventually(lambda: gw.metric("gateway_tracing_spans_dropped_total", reason="export_failed") > 0, timeout=30)


def test_http_protobuf_and_the_otel_variables_that_win_over_the_config(
    emulators: Emulators, gateway: StartGateway, receiver: Receiver,
) -> None:
    emu = emulators.start("vllm")
    gw = gateway([backend_entry("a", emu, "vllm")], env=FAST_EXPORT,
                 tracing={"otlp_endpoint": receiver.http_endpoint, "protocol": "http/protobuf",
                          "service_name": "edge-gw"})
    spans = receiver.wait_for(lambda s: len(s) >= 3, trace_id=post(gw, CHAT).headers["x-trace-id"])
    assert {s.via for s in spans} == {"http"}
    assert {s.service for s in spans} == {"edge-gw"}
    # no `tracing` section at all: the standard variables turn it on, and name the service
    env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.grpc_endpoint, "OTEL_SERVICE_NAME": "env-gw"}
    gw2 = gateway([backend_entry("a", emu, "vllm")], env=env)
    spans = receiver.wait_for(lambda s: len(s) >= 3, trace_id=post(gw2, CHAT).headers["x-trace-id"])
    assert {s.service for s in spans} == {"env-gw"}
    assert {s.via for s in spans} == {"grpc"}
    # and without either, tracing is off: no trace id, nothing exported
    gw3 = gateway([backend_entry("a", emu, "vllm")])
    assert "x-trace-id" not in post(gw3, CHAT).headers
    assert "gateway_tracing_spans_exported" not in gw3.get("/metrics").text


def test_a_shadow_copy_is_a_marked_attempt_in_the_same_trace(
    emulators: Emulators, gateway: StartGateway, receiver: Receiver,
) -> None:
    a, b = emulators.start("vllm"), emulators.start("sglang")
    routes = [{"model": "moe", "split": {"arms": [{"name": "main", "weight": 1, "backends": ["a"]},
                                                   {"name": "shadowed", "weight": 0, "backends": ["b"]}],
                                          "shadow": {"arm": "shadowed", "fraction": 1.0}}}]
    gw = gateway([backend_entry("a", a, "vllm"), backend_entry("b", b, "sglang")], routes, env=FAST_EXPORT,
                 tracing=tracing(receiver))
    resp = post(gw, CHAT)
    assert resp.status_code == 200
    assert resp.headers["x-gateway-backend"] == "a"
    spans = receiver.wait_for(lambda s: len(by_kind(s, "CLIENT")) >= 2, trace_id=resp.headers["x-trace-id"])
    server = one(spans, "SERVER")
    shadow = [s for s in by_kind(spans, "CLIENT") if s.attributes.get("gateway.shadow")]
    main = [s for s in by_kind(spans, "CLIENT") if not s.attributes.get("gateway.shadow")]
    assert [s.attributes["gateway.backend"] for s in shadow] == ["b"]
    assert len(main) == 1
    assert shadow[0].parent_span_id == server.span_id
    assert server.attributes["gateway.ab.arm"] == "main"


def test_the_latest_genai_names_behind_the_opt_in(
    emulators: Emulators, gateway: StartGateway, receiver: Receiver,
) -> None:
    emu = emulators.start("vllm")
    body = {**CHAT, "reasoning_effort": "low", "top_k": 5}
    gw = gateway([backend_entry("a", emu, "vllm")], env=FAST_EXPORT, tracing=tracing(receiver))
    server = one(receiver.wait_for(lambda s: len(s) >= 3, trace_id=post(gw, body).headers["x-trace-id"]), "SERVER")
    assert "gen_ai.request.reasoning.level" not in server.attributes  # v1.41 has no such attribute
    assert server.attributes["gen_ai.request.top_k"] == 5.0
    assert isinstance(server.attributes["gen_ai.request.top_k"], float)
    latest = gateway([backend_entry("a", emu, "vllm")], tracing=tracing(receiver),
                     env={**FAST_EXPORT, "OTEL_SEMCONV_STABILITY_OPT_IN": "http,gen_ai_latest_experimental"})
    server = one(receiver.wait_for(lambda s: len(s) >= 3, trace_id=post(latest, body).headers["x-trace-id"]), "SERVER")
    assert server.attributes["gen_ai.request.reasoning.level"] == "low"
    assert server.attributes["gen_ai.request.top_k"] == 5
    assert isinstance(server.attributes["gen_ai.request.top_k"], int)


def _exemplars(text: str, family: str) -> list[tuple[dict[str, str], Any]]:
    found = []
    for fam in text_string_to_metric_families(text):  # type: ignore[no-untyped-call]
        if fam.name == family:
            found += [(s.labels, s.exemplar) for s in fam.samples if s.exemplar is not None]
    return found


@pytest.mark.parametrize("workers", [1, 2])
def test_exemplars_link_the_ttft_and_duration_buckets_to_sampled_traces(
    emulators: Emulators, gateway: StartGateway, receiver: Receiver, workers: int,
) -> None:
    emu = emulators.start("vllm")
    gw = gateway([backend_entry("a", emu, "vllm")], env=FAST_EXPORT, tracing=tracing(receiver), workers=workers)
    traced = {post(gw, {**CHAT, "stream": True}).headers["x-trace-id"] for _ in range(4)}
    accept = {"Accept": "application/openmetrics-text; version=1.0.0"}

    def exposition() -> str:
        resp = gw.get("/metrics", headers=accept)
        assert resp.headers["content-type"].startswith("application/openmetrics-text")
        return resp.text

    # (under --workers N the supervisor merges the workers' pages: the exemplars survive it)
    eventually(lambda: bool(_exemplars(exposition(), "gateway_time_to_first_token_seconds")), timeout=30)
    text = exposition()
    for family in ("gateway_time_to_first_token_seconds", "gateway_request_duration_seconds",
                   "gen_ai_server_time_to_first_token_seconds", "gen_ai_server_request_duration_seconds"):
        linked = _exemplars(text, family)
        assert linked, family
        for labels, exemplar in linked:
            assert exemplar.labels["trace_id"] in traced
            assert float(labels["le"]) >= exemplar.value
    assert "# {" not in gw.get("/metrics").text  # the Prometheus text format has no exemplars
    # the spans of every worker reach the collector, each process with its own identity
    spans = receiver.wait_for(lambda s: {x.trace_id for x in by_kind(s, "SERVER")} >= traced)
    assert all(s.resource["service.instance.id"] for s in spans)


def test_the_access_log_has_each_requests_trace_id(
    emulators: Emulators, gateway: StartGateway, receiver: Receiver,
) -> None:
    emu = emulators.start("vllm")
    gw = gateway([backend_entry("a", emu, "vllm")], env=FAST_EXPORT, tracing=tracing(receiver),
                 listen={"access_log": True})
    resp = post(gw, CHAT, **{"x-request-id": "req-17"})
    trace_id = resp.headers["x-trace-id"]
    eventually(lambda: f"request_id=req-17 trace_id={trace_id}" in gw.log_path.read_text())
    line = next(x for x in gw.log_path.read_text().splitlines() if "req-17" in x)
    assert "gateway.access: access chat moe status=200 backend=a runtime=vllm" in line
