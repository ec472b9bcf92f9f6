"""Responses requests served as chat (`responses_chat`, `responses_stream`, `responses_bridge`):
translated requests, answers that the OpenAI SDK's own pydantic types validate, streams that are the
same whatever the byte boundaries, on captured vLLM chat streams and on Triton's translation."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from backends.base import ClientRequest, Endpoint, TranslationError, Usage
from backends.responses_bridge import ResponsesBridge
from backends.responses_chat import from_chat, to_chat, untranslatable
from backends.responses_stream import ChatToResponsesStream
from backends.triton import TritonAdapter
from backends.vllm import VLLMAdapter
from tests.data import EMULATOR_CAPTURES, VLLM_CAPTURES
from tests.unit.backends.streams import fed

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}


def capture_body(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw.partition(b"### response\n")[2].partition(b"\n\n")[2]


def events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for block in data.split(b"\n\n"):
        if block:
            kind, payload = block.split(b"\n", 1)
            assert kind.startswith(b"event: ")
            obj = orjson.loads(payload.removeprefix(b"data: "))
            assert obj["type"] == kind.removeprefix(b"event: ").decode()
            out.append(obj)
    return out


def test_a_responses_request_becomes_chat() -> None:
    body = {
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 30, "temperature": 0.5, "stream": True,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                       "text": "Paris?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"role": "developer", "content": "answer now"},
        ],
        "tools": [FUNCTION], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "low"}, "store": False, "metadata": {"a": "b"},
    }
    assert untranslatable(body) is None
    assert to_chat(body) == {
        "model": "m", "stream": True, "max_tokens": 30, "temperature": 0.5,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "system", "content": "answer now"},
        ],
        "tools": [{"type": "function", "function": {k: v for k, v in FUNCTION.items() if k != "type"}}],
        "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"},
                                                                   "strict": True}},
        "reasoning_effort": "low",
    }


@pytest.mark.parametrize(("extra", "field"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"conversation": "c"}, "conversation"),
    ({"background": True}, "background"), ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
])
def test_what_chat_cannot_express_is_named(extra: dict[str, Any], field: str) -> None:
    body = {"model": "m", "input": "hi", **extra}
    assert untranslatable(body) == field
    with pytest.raises(TranslationError, match=field):
        to_chat(body)


def test_a_chat_answer_becomes_a_response_the_sdk_reads() -> None:
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris is sunny."},
                         "finish_reason": "length"}]}
    obj = from_chat(chat, {"model": "m", "input": "hi", "max_output_tokens": 4}, request_id="abc", created=7,
                    model="moe", usage=Usage(10, 4, 2))
    resp = Response.model_validate(obj)
    assert (resp.id, resp.status, resp.model, resp.created_at) == ("resp_abc", "incomplete", "moe", 7)
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "Paris is sunny."
    assert resp.usage is not None
    usage = resp.usage
    assert (usage.input_tokens, usage.output_tokens, usage.input_tokens_details.cached_tokens) == (10, 4, 2)
    call = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}]}
    resp = Response.model_validate(from_chat(call, {"input": "x", "tools": [FUNCTION]}, request_id="r", created=0,
                                             model="m", usage=None))
    [item] = resp.output
    assert item.type == "function_call"
    assert (item.call_id, item.name, item.arguments, resp.status) == ("call_1", "get_weather", '{"city": "Paris"}',
                                                                      "completed")


def _translate(data: bytes, cuts: list[int], body: dict[str, Any]) -> bytes:
    return fed(ChatToResponsesStream(None, body, model="moe", request_id="rid", created=5), data, cuts)


@pytest.mark.parametrize("capture", [VLLM_CAPTURES / "chat_stream_usage.txt",
                                     EMULATOR_CAPTURES / "vllm-0.32.0-cpu/chat_tool_required_stream.txt"])
def test_a_captured_chat_stream_becomes_valid_responses_events_at_any_split(capture: Path) -> None:
    data = capture_body(capture)
    body = {"model": "m", "input": "hi", "tools": [FUNCTION]}
    whole = _translate(data, [], body)
    rng = random.Random(3)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(data)), 5))
        assert _translate(data, cuts, body) == whole
    evs = events(whole)
    for e in evs:
        EVENTS.validate_python(e)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert evs[0]["type"] == "response.created"
    assert evs[-1]["type"] == "response.completed"
    final = Response.model_validate(evs[-1]["response"])
    chunks = [orjson.loads(b[6:]) for b in data.split(b"\n\n") if b.startswith(b"data: {")]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    text = "".join(d.get("content") or "" for d in deltas)
    args = "".join(tc["function"].get("arguments") or "" for d in deltas for tc in d.get("tool_calls") or ())
    assert final.output_text == text
    assert "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta") == text
    if args:
        [call] = [o for o in final.output if o.type == "function_call"]
        assert call.arguments == args
        assert call.name == "get_weather"


def test_a_chat_error_ends_the_responses_stream_with_an_error_the_sdk_raises_on() -> None:
    data = (b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
            b'data: {"error":{"message":"boom","type":"server_error","param":null,"code":500}}\n\n'
            b'data: {"choices":[{"index":0,"delta":{"content":"b"},"finish_reason":null}]}\n\ndata: [DONE]\n\n')
    evs = events(_translate(data, [], {"input": "x"}))
    assert [e["type"] for e in evs][-1] == "error"
    assert evs[-1]["error"]["message"] == "boom"  # a top-level `error`: the SDK raises APIError
    assert all(e["type"] != "response.completed" for e in evs)


def test_a_stream_cut_before_done_does_not_complete() -> None:
    data = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
    assert all(e["type"] != "response.completed" for e in events(_translate(data, [], {"input": "x"})))


def _request(stream: bool) -> ClientRequest:
    return ClientRequest(endpoint=Endpoint.RESPONSES, body={"model": "moe", "input": "Tell me", "stream": stream,
                                                           "max_output_tokens": 3}, stream=stream,
                         include_usage=False, created=11)


def test_triton_serves_responses_through_the_bridge() -> None:
    bridge = ResponsesBridge(TritonAdapter())
    up = bridge.build_request(_request(False), model="ensemble", request_id="u1")
    assert up.path == "/v2/models/ensemble/generate"
    sent = orjson.loads(up.body)
    assert sent["text_input"].endswith("<|im_start|>assistant\n")
    assert sent["max_tokens"] == 3
    reply = bridge.translate_response(_request(False), 200, orjson.dumps(
        {"text_output": "Hi there", "num_input_tokens": 9, "num_output_tokens": 3}), model="moe", request_id="g1")
    resp = Response.model_validate(orjson.loads(reply.body))
    assert (resp.output_text, resp.status, resp.id, resp.created_at) == ("Hi there", "incomplete", "resp_g1", 11)
    assert reply.usage == Usage(9, 3)
    translator = bridge.stream_translator(_request(True), model="moe", request_id="g2")
    assert translator is not None
    raw = b"".join(b'data: {"text_output":"%s","num_output_tokens":1}\n\n' % t for t in (b"Hi", b" the", b"re"))
    evs = events(translator.feed(raw) + translator.close())
    for e in evs:
        EVENTS.validate_python(e)
    final = Response.model_validate(evs[-1]["response"])
    assert final.output_text == "Hi there"
    assert final.usage is not None
    assert final.usage.output_tokens == 3


def test_vllm_passes_responses_through_and_other_endpoints_are_untouched_by_the_bridge() -> None:
    up = VLLMAdapter().build_request(_request(True), model="tiny-moe", request_id="u")
    assert up.path == "/v1/responses"
    assert orjson.loads(up.body) == {"model": "tiny-moe", "input": "Tell me", "stream": True, "max_output_tokens": 3}
    chat = ClientRequest(endpoint=Endpoint.CHAT, body={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                         stream=False, include_usage=False)
    assert ResponsesBridge(VLLMAdapter()).build_request(chat, model="t", request_id="u") == \
        VLLMAdapter().build_request(chat, model="t", request_id="u")
