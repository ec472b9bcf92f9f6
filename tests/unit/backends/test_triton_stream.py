from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from backends.base import ClientRequest, Endpoint
from backends.triton import TritonAdapter
from backends.triton_stream import TritonStreamTranslator
from tests.unit.backends.streams import fed

CHAT = ClientRequest(
    endpoint=Endpoint.CHAT,
    body={"messages": [{"role": "user", "content": "Count"}], "max_tokens": 3, "stream": True},
    stream=True,
    include_usage=False,
    created=1764434400,
)
HEAD = {"id": "chatcmpl-req1", "object": "chat.completion.chunk", "created": 1764434400, "model": "route"}
META = {"context_logits": 0.0, "model_name": "ensemble", "model_version": "1", "sequence_end": False}


def _upstream(*events: dict[str, Any], sep: bytes = b"\n") -> bytes:
    return b"".join(b"data: " + orjson.dumps({**META, **e}) + sep + sep for e in events)


# Multi-byte UTF-8 in the middle, so splits land inside characters too. Streamed, TensorRT-LLM's
# num_output_tokens counts each response's own tokens.
STREAM = _upstream(
    {"text_output": "Count", "num_input_tokens": 12, "num_output_tokens": 1},
    {"text_output": "ing 😀 é", "num_input_tokens": 12, "num_output_tokens": 1},
    {"text_output": "!", "num_input_tokens": 12, "num_output_tokens": 1},
)


def _translator(req: ClientRequest = CHAT) -> TritonStreamTranslator:
    return TritonAdapter().stream_translator(req, model="route", request_id="req1")


def _run(data: bytes, cuts: list[int], req: ClientRequest = CHAT) -> bytes:
    return fed(_translator(req), data, cuts)


def _events(out: bytes) -> list[Any]:
    assert out.endswith(b"\n\n")
    return [
        orjson.loads(e.removeprefix(b"data: ")) if e != b"data: [DONE]" else "[DONE]" for e in out[:-2].split(b"\n\n")
    ]


def test_translates_to_openai_chunks() -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**HEAD, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    assert _events(_run(STREAM, [])) == [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Count"}),
        chunk({"content": "ing 😀 é"}),
        chunk({"content": "!"}),
        chunk({}, "length"),  # 3 output tokens == max_tokens
        {**HEAD, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}},
        "[DONE]",
    ]


def test_every_single_split_gives_identical_output() -> None:
    expected = _run(STREAM, [])
    for i in range(len(STREAM) + 1):
        assert _run(STREAM, [i]) == expected, f"split at {i}"


def test_random_multi_splits_and_byte_at_a_time_give_identical_output() -> None:
    expected = _run(STREAM, [])
    assert _run(STREAM, list(range(1, len(STREAM)))) == expected
    rng = random.Random(1234)
    for _ in range(500):
        cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 12)))
        assert _run(STREAM, cuts) == expected, cuts


def test_crlf_comments_and_a_missing_final_blank_line() -> None:
    data = b": keep-alive\r\n\r\n" + _upstream({"text_output": "Hi"}, sep=b"\r\n").removesuffix(b"\r\n\r\n")
    events = _events(_run(data, [3]))
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}, {"content": "Hi"}]
    # No counts reported: one token per event, prompt estimated as ceil(len(text_input) / 4).
    text_input = "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n"
    prompt = -(-len(text_input) // 4)
    assert events[3]["usage"] == {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}
    assert events[2]["choices"][0]["finish_reason"] == "stop"


def test_per_event_token_counts_are_summed() -> None:
    data = _upstream({"text_output": "a", "num_output_tokens": 1}, {"text_output": "b", "num_output_tokens": 1})
    assert _events(_run(data, []))[-2]["usage"]["completion_tokens"] == 2


def test_increasing_per_event_counts_are_not_read_as_running_totals() -> None:
    # Three responses of 1, 2 and 3 tokens (a backend that batches tokens per response) are 6 tokens, not 3.
    data = _upstream({"text_output": "a", "num_output_tokens": 1}, {"text_output": "b c", "num_output_tokens": 2},
                     {"text_output": "d e f", "num_output_tokens": 3})
    events = _events(_run(data, []))
    assert events[-2]["usage"]["completion_tokens"] == 6
    assert events[-3]["choices"][0]["finish_reason"] == "length"  # 6 >= max_tokens 3


def test_completions_chunks() -> None:
    req = ClientRequest(
        endpoint=Endpoint.COMPLETIONS, body={"prompt": "Once", "stream": True}, stream=True, include_usage=True
    )
    events = _events(_run(_upstream({"text_output": " upon"}), [], req))
    head = {"id": "cmpl-req1", "object": "text_completion", "created": 0, "model": "route"}
    assert events == [
        {**head, "choices": [{"index": 0, "text": " upon", "logprobs": None, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
        "[DONE]",
    ]


@pytest.mark.parametrize(
    ("bad_event", "message"),
    [
        (b'data: {"error":"Request cancelled"}\n\n', "Request cancelled"),
        (b"data: not json\n\n", "Malformed event from backend"),
    ],
)
def test_error_events_end_the_stream(bad_event: bytes, message: str) -> None:
    data = _upstream({"text_output": "a"}) + bad_event + _upstream({"text_output": "ignored"})
    events = _events(_run(data, [len(data) // 2]))
    assert events[-2] == {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    assert events[-1] == "[DONE]"
    assert all("ignored" not in orjson.dumps(e).decode() for e in events)


def test_empty_stream_still_closes_properly_and_close_is_idempotent() -> None:
    t = _translator()
    assert t.feed(b"") == b""
    events = _events(t.close())
    assert [e if e == "[DONE]" else e["choices"] for e in events][-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert t.close() == b""
    assert t.feed(b"data: {}\n\n") == b""
