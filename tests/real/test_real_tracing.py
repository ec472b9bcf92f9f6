"""One request's trace from the client through the gateway into a real vLLM: the session vLLM runs with
`--otlp-traces-endpoint` to the session's OTLP receiver (conftest), a gateway with tracing exports
to the same receiver, and vLLM's own span (`llm_request`: its queue, prefill and decode times) joins
the trace as the child of the gateway's attempt span, because the attempt sent it `traceparent`.

With `IGW_TRACE_PNG=path` the trace is also drawn as a waterfall there (the README's picture).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.waterfall import Row, render, save
from tests.integration.harness import GatewayProcess
from tests.otlp import Receiver, Span

from .harness import BACKEND_NAME, ROUTE_MODEL, SERVED_MODEL, ServerProcess

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]
CLIENT_TRACE = "5a1d0c0ffee0000000000000000d00d5"
CLIENT_SPAN = "c0ffee0000000001"


@pytest.fixture(scope="module")
def traced_gateway(vllm_server: ServerProcess, otlp: Receiver, tmp_path_factory: pytest.TempPathFactory,
                   ) -> Iterator[GatewayProcess]:
    config = {
        "backends": [{"name": BACKEND_NAME, "runtime": "vllm", "url": vllm_server.url, "model": SERVED_MODEL,
                      "usd_per_hour": 1.0}],
        "routes": [{"model": ROUTE_MODEL, "backends": [BACKEND_NAME], "policy": "least_load"}],
        "tracing": {"otlp_endpoint": otlp.grpc_endpoint, "service_name": "gateway"},
    }
    gw = GatewayProcess(config, tmp_path_factory.mktemp("traced-gateway"), env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    yield gw
    gw.stop()


def test_vllms_span_is_in_the_trace_as_the_child_of_the_gateways_attempt(
    traced_gateway: GatewayProcess, otlp: Receiver, vllm_server: ServerProcess, tmp_path: Path,
) -> None:
    body = {"model": ROUTE_MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}
    resp = httpx.post(traced_gateway.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert resp.status_code == 200
    assert resp.headers["x-trace-id"] == CLIENT_TRACE

    def complete(spans: list[Span]) -> bool:
        return any(s.service == "vllm" for s in spans) and any(s.kind == "SERVER" and s.service == "gateway"
                                                                for s in spans)

    spans = otlp.wait_for(complete, trace_id=CLIENT_TRACE, timeout=60, what="the gateway's and vLLM's spans")
    server = next(s for s in spans if s.service == "gateway" and s.kind == "SERVER")
    attempt = next(s for s in spans if s.service == "gateway" and s.kind == "CLIENT")
    engine = next(s for s in spans if s.service == "vllm")
    assert server.parent_span_id == CLIENT_SPAN
    assert attempt.parent_span_id == server.span_id
    assert engine.parent_span_id == attempt.span_id  # vLLM continued the trace the attempt sent it
    assert engine.name == "llm_request"
    assert engine.kind == "SERVER"
    assert attempt.start_ns <= engine.end_ns <= attempt.end_ns + 50_000_000  # within the attempt (clock skew: none)
    assert engine.attributes["gen_ai.usage.completion_tokens"] == server.attributes["gen_ai.usage.output_tokens"]
    assert engine.attributes["gen_ai.usage.prompt_tokens"] == server.attributes["gen_ai.usage.input_tokens"]
    assert attempt.attributes["gateway.upstream.request.id"] in engine.attributes["gen_ai.request.id"]
    assert attempt.attributes["server.port"] == vllm_server.port
    out = Path(os.environ.get("IGW_TRACE_PNG") or tmp_path / "trace.png")
    rows = [Row(s.service, s.name, s.kind, s.span_id, s.parent_span_id, s.start_ns, s.end_ns, s.attributes)
            for s in spans]
    save(rows, out.with_suffix(".json"))
    render(rows, out, title="one streamed chat completion: the gateway's spans and vLLM's, one trace")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
