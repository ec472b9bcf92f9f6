"""The bytes `bench overhead` sends and serves are issue 13's: a 1.2 KB request with a ~1 KB system
prompt, nginx's stream of exactly 20 data events + [DONE], and a dripping stream of one event per write."""

from __future__ import annotations

import orjson

from bench import chat_bodies, drip_sse
from bench.upstream import bodies


def _events(sse: bytes) -> list[bytes]:
    return [line.removeprefix(b"data: ") for line in sse.split(b"\n") if line.startswith(b"data:")]


def test_the_request_is_1_2_kb_with_a_1_kb_system_prompt_and_the_same_every_time() -> None:
    body = chat_bodies.chat()
    system = body["messages"][0]
    assert system["role"] == "system"
    assert 900 <= len(system["content"].encode()) <= chat_bodies.SYSTEM_BYTES
    assert 1100 <= chat_bodies.size(body) <= 1300
    assert orjson.dumps(body) == orjson.dumps(chat_bodies.chat())
    stream = chat_bodies.stream(max_tokens=bodies.TOKENS)
    assert stream["stream"] is True
    assert stream["stream_options"] == {"include_usage": True}
    assert stream["messages"] == body["messages"]


def test_the_canned_stream_is_exactly_20_data_events_then_done_as_vllm_sends_them() -> None:
    on_disk = (bodies.HERE / "stream.sse").read_bytes()
    assert on_disk == bodies.sse_stream(), "stream.sse is stale: run `python -m bench.upstream.bodies`"
    events = _events(on_disk)
    assert len(events) == bodies.STREAM_EVENTS + 1 == 21
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    tokens = chunks[1:-1]
    assert len(tokens) == bodies.TOKENS == 18
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 17 + ["length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 18


def test_the_dripping_stream_has_one_event_per_write_and_ends_the_chunked_body_with_done() -> None:
    writes = drip_sse.stream_writes(64)
    assert len(writes) == 67
    for w in writes:
        size, _, rest = w.partition(b"\r\n")
        payload = rest[: int(size, 16)]
        assert len(_events(payload)) == 1
        assert rest[int(size, 16):] in (b"\r\n", b"\r\n0\r\n\r\n")
    assert writes[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    usage = orjson.loads(_events(writes[-2])[0])
    assert usage["usage"]["completion_tokens"] == 64
