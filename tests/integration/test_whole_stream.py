"""A short stream that reaches the gateway whole, with its head, in one read: relayed to the client in
one write (`Relay.stream`, `ResponseSink.send_stream`), measured and counted as any other stream, and a
whole stream that lacks its `[DONE]` still ends with an error event. A canned backend on a real
socket (tests/integration/fakes.py), a real `gateway serve`, the official SDK."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import openai
import pytest

from .fakes import CannedStreamServer, start_canned_stream_server
from .harness import GatewayProcess, LoopThread, eventually

StartGateway = Callable[..., GatewayProcess]
HEAD = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"tiny-moe","choices":'
EVENTS = (
    HEAD + b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    + b"".join(HEAD + b'[{"index":0,"delta":{"content":"%b"},"finish_reason":null}]}\n\n' % t
               for t in (b"Hello", b",", b" world"))
    + HEAD + b'[{"index":0,"delta":{"content":"!"},"finish_reason":"stop"}]}\n\n'
    + HEAD + b'[],"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13}}\n\n'
)


@pytest.fixture
def canned(loop_thread: LoopThread, request: pytest.FixtureRequest) -> Iterator[CannedStreamServer]:
    server = loop_thread.run(start_canned_stream_server(request.param))
    yield server
    server.server.close()


def start(gateway: StartGateway, canned: CannedStreamServer) -> GatewayProcess:
    return gateway([{"name": "canned", "runtime": "vllm", "url": canned.url, "model": "tiny-moe"}])


@pytest.mark.parametrize("canned", [EVENTS + b"data: [DONE]\n\n"], indirect=True)
def test_a_stream_that_arrives_whole_is_relayed_measured_and_counted_once(
    canned: CannedStreamServer, gateway: StartGateway
) -> None:
    gw = start(gateway, canned)
    chunks = list(gw.client().chat.completions.create(
        model="moe", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world!"
    assert {c.model for c in chunks} == {"moe"}  # renamed to the client's name, in every event
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    eventually(lambda: gw.metric("gateway_requests_total", backend="canned", status="200") == 1)
    assert gw.metric("gateway_tokens_total", backend="canned", kind="completion") == 4
    assert gw.metric("gateway_time_to_first_token_seconds_count", backend="canned") == 1


@pytest.mark.parametrize("canned", [EVENTS], indirect=True)
def test_a_whole_stream_without_its_done_ends_with_an_error_event(
    canned: CannedStreamServer, gateway: StartGateway
) -> None:
    gw = start(gateway, canned)
    resp = gw.post("/v1/chat/completions", json={"model": "moe", "messages": [{"role": "user", "content": "hi"}],
                                                 "stream": True})
    assert resp.status_code == 200
    text = resp.text
    assert text.count('"content":"') == 5  # every event the backend sent, then the error
    assert '"upstream_stream_error"' in text
    assert text.endswith("data: [DONE]\n\n")
    eventually(lambda: gw.metric("gateway_requests_total", backend="canned", status="stream_error") == 1)
    with pytest.raises(openai.APIError):
        list(gw.client().chat.completions.create(model="moe", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True))
