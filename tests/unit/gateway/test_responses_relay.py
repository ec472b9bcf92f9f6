"""The Responses stream relay (`proxy.responses_sse`) on a real vLLM 0.32 Responses stream: usage from
`response.completed`, TTFT at the first output delta, one token per delta, the model renamed, the
response id kept, any split of the bytes giving the same output."""

from __future__ import annotations

import random

import orjson
import pytest

from backends.base import ErrorBody, Usage
from gateway.proxy.responses_sse import ResponsesSseRelay
from gateway.proxy.sse import SseFramingError
from tests.data import EMULATOR_CAPTURES

STREAM = (EMULATOR_CAPTURES / "vllm-0.32.0-cpu/responses_stream.txt").read_bytes().partition(
    b"### response\n")[2].partition(b"\n\n")[2]


def relay() -> ResponsesSseRelay:
    return ResponsesSseRelay(backend_model="tiny-moe", client_model="moe")


def test_a_captured_stream_is_measured_and_renamed() -> None:
    r = relay()
    out = b""
    now = 0.0
    for block in STREAM.split(b"\n\n")[:-1]:  # one event per read, 10 ms apart
        now += 0.01
        out += r.feed(block + b"\n\n", now)
    out += r.close(now)
    stats = r.stats
    assert stats.done
    assert stats.error is None
    assert stats.usage == Usage(prompt_tokens=17, completion_tokens=4, cached_tokens=0)
    assert stats.tokens == 4  # four response.output_text.delta events
    assert stats.first_token_at == pytest.approx(0.05)  # the 5th event is the first delta
    assert stats.gaps.count == 3
    assert stats.gaps.mean_s == pytest.approx(0.01)
    assert r.response_id == "resp_9d5f561dc7d699d0"
    assert b'"model":"tiny-moe"' not in out
    assert out.count(b'"model":"moe"') == 3
    assert out.replace(b'"model":"moe"', b'"model":"tiny-moe"') == STREAM


def test_any_split_gives_the_same_bytes_and_figures() -> None:
    whole = relay()
    expected = whole.feed(STREAM, 1.0) + whole.close(1.0)
    rng = random.Random(7)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(STREAM)), 8))
        r = relay()
        out, prev = b"", 0
        for cut in [*cuts, len(STREAM)]:
            out += r.feed(STREAM[prev:cut], 1.0)
            prev = cut
        out += r.close(1.0)
        assert out == expected
        assert r.stats.usage == whole.stats.usage
        assert r.stats.tokens == 4
        assert r.stats.done


def test_crlf_and_events_without_event_lines_are_read() -> None:
    r = relay()
    data = STREAM.replace(b"\n", b"\r\n")
    r.feed(data, 0.0)
    assert r.stats.done
    assert r.stats.tokens == 4
    plain = b"".join(b"data: " + line.split(b"data: ", 1)[1] + b"\n\n" for line in STREAM.split(b"\n\n") if line)
    r2 = relay()
    r2.feed(plain, 0.0)
    assert r2.stats.done
    assert r2.stats.tokens == 4
    assert r2.stats.usage is not None


def test_errors_and_failed_responses_are_the_streams_error() -> None:
    r = relay()
    r.feed(b'event: error\ndata: {"type":"error","code":"x","message":"engine died","param":null,'
           b'"sequence_number":3}\n\n', 0.0)
    assert r.stats.error is not None
    assert r.stats.error.message == "engine died"
    failed = {"type": "response.failed", "sequence_number": 2,
              "response": {"error": {"message": "oom", "code": "server_error"}, "usage": None}}
    r2 = relay()
    r2.feed(b"event: response.failed\ndata: " + orjson.dumps(failed) + b"\n\n", 0.0)
    assert r2.stats.done
    assert r2.stats.error is not None
    assert r2.stats.error.message == "oom"


def test_the_gateways_own_error_continues_the_sequence() -> None:
    r = relay()
    head, _, _ = STREAM.partition(b"event: response.output_text.done")
    r.feed(head, 0.0)
    tail = r.error_tail(ErrorBody("The backend failed mid-stream (x).", "server_error", code="upstream_stream_error"))
    kind, data = tail.rstrip(b"\n").split(b"\n")
    event = orjson.loads(data.removeprefix(b"data: "))
    assert kind == b"event: error"
    assert event["sequence_number"] == 8
    assert event["error"]["code"] == "upstream_stream_error"


def test_an_endless_event_is_refused() -> None:
    with pytest.raises(SseFramingError):
        relay().feed(b"event: response.output_text.delta\ndata: " + b"x" * (1024 * 1024 + 10), 0.0)
