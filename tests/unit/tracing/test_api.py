"""The tracing API as code outside the HTTP fronts calls it (a disaggregated request's prefill and
decode legs, a gRPC endpoint picker that reuses routing and accounting): a real `Tracer`, exporting
to the tests' OTLP receiver, driven step by step with plain values."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from backends.base import ClientRequest, Endpoint, Usage
from backends.registry import adapter_for
from gateway.errors import BackendTimeout
from gateway.observability.outcome import Outcome
from gateway.routing import Decision
from gateway.settings import Backend, Tracing
from gateway.state.pool import BackendState
from gateway.tracing.config import resolve
from gateway.tracing.tracer import Tracer
from tests.otlp import Receiver

PREFILL = Backend(name="p", runtime="vllm", url="http://10.0.0.1:8100", model="m")
DECODE = Backend(name="d", runtime="vllm", url="http://10.0.0.2:8200", model="m")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rx = Receiver()
    yield rx
    rx.stop()


def tracer(rx: Receiver, ratio: float = 1.0) -> Tracer:
    config = resolve(Tracing(otlp_endpoint=rx.grpc_endpoint, sample_ratio=ratio), {"OTEL_BSP_SCHEDULE_DELAY": "50"})
    assert config is not None
    return Tracer(config, throughput=lambda backend: 100.0)


def state(config: Backend) -> BackendState:
    return BackendState(config=config, adapter=adapter_for(config.runtime))


def test_prefill_and_decode_legs_are_client_spans_of_the_request_each_sent_its_own_traceparent(
    receiver: Receiver,
) -> None:
    t = tracer(receiver)
    trace = t.start({"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}, Endpoint.CHAT, "req-1")
    trace.parsed("moe", ClientRequest(Endpoint.CHAT, {"model": "moe", "max_tokens": 8}, stream=True,
                                      include_usage=True))
    trace.routing()
    trace.routed("pd", ["p", "d"], Decision("p", "pd"), arm=None, ab_excluded=None, sla=None)
    prefill = trace.leg("prefill", state(PREFILL), {"x-request-id": "u-1"}, "u-1")
    assert prefill.headers["x-request-id"] == "u-1"  # the caller's headers, plus the trace's
    prefill.end(status=200)
    decode = trace.leg("decode", state(DECODE), {}, "u-2")
    decode.end(BackendTimeout("d", "no first token"))
    trace.finish(Outcome("d", "vllm", "moe", "504", 1.5, usage=Usage(10, 0)), state(DECODE))
    t.batcher.shutdown(5.0)
    spans = receiver.wait_for(lambda s: len(s) == 4, trace_id="ab" * 16)
    server = next(s for s in spans if s.kind == "SERVER")
    legs = {s.attributes["gateway.leg"]: s for s in spans if s.kind == "CLIENT"}
    assert server.parent_span_id == "cd" * 8
    assert {s.parent_span_id for s in legs.values()} == {server.span_id}
    assert prefill.headers["traceparent"] == f"00-{'ab' * 16}-{legs['prefill'].span_id}-01"
    assert decode.headers["traceparent"] == f"00-{'ab' * 16}-{legs['decode'].span_id}-01"
    assert legs["prefill"].attributes["server.address"] == "10.0.0.1"
    assert legs["prefill"].attributes["server.port"] == 8100
    assert legs["prefill"].attributes["http.response.status_code"] == 200
    assert legs["decode"].attributes["error.type"] == "timeout"
    assert legs["decode"].status == "ERROR"
    assert server.attributes["error.type"] == "504"
    assert server.name == "chat moe"


def test_an_unsampled_request_records_nothing_and_passes_its_context_on_unsampled(receiver: Receiver) -> None:
    t = tracer(receiver, ratio=0.0)
    trace = t.start({}, Endpoint.CHAT, "req-2")
    assert not trace.sampled
    leg = trace.leg("prefill", state(PREFILL), {}, "u-3")
    version, trace_id, _span, flags = leg.headers["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", trace.trace_id_hex, "00")
    assert trace.attempt(state(DECODE), {}, "u-4")["traceparent"] == leg.headers["traceparent"]  # one hop
    leg.end()
    trace.finish(Outcome("d", "vllm", "moe", "200", 0.1), None)
    t.batcher.shutdown(5.0)
    assert receiver.spans == []
    assert t.batcher.exported == 0
