"""`POST /v1/responses` on the vLLM, SGLang and trtllm-serve faces (issue 16), through the official
SDK (`client.responses.create` / `client.responses.stream`) and on the wire (SSE `event:` lines,
`sequence_number`), and through the same engine as chat (prompt tokens, prefix cache)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import aiohttp
import jsonschema_rs
import openai
import orjson
import pytest
from openai.types.responses import FunctionToolParam, ResponseInputParam

from tests.emulator.conftest import MakeEmulator

RUNTIMES = ["vllm", "sglang", "trtllm"]
PARAMS: dict[str, Any] = {
    "type": "object", "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                   "unit": {"type": "string", "enum": ["c", "f"]}},
}
TOOL: FunctionToolParam = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMS,
                           "strict": False}
TEXT_EVENTS = [
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    "response.output_text.delta", "response.output_text.done", "response.content_part.done",
    "response.output_item.done",
]


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)


@pytest.fixture(params=RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> str:
    """Every runtime, unless a test parametrises `runtime` itself."""
    param: str = request.param
    return param


@pytest.fixture
async def client(emulator: MakeEmulator, runtime: str) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official SDK against an emulator of `runtime`."""
    emu = await emulator(runtime)
    async with client_for(emu.url) as c:
        yield c


def collapse(types: Sequence[str]) -> list[str]:
    """Event types with runs of the same delta type collapsed to one."""
    out: list[str] = []
    for t in types:
        if not (out and out[-1] == t and t.endswith(".delta")):
            out.append(t)
    return out


async def raw_stream(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/responses", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    events = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        event_line, data_line = block.split(b"\n")
        assert event_line.startswith(b"event: ")
        assert data_line.startswith(b"data: ")
        events.append((event_line.removeprefix(b"event: ").decode(), orjson.loads(data_line.removeprefix(b"data: "))))
    return events


async def test_create_with_string_input(client: openai.AsyncOpenAI, runtime: str) -> None:
    resp = await client.responses.create(model="tiny-moe", input="Tell me about the sea.", max_output_tokens=8)
    assert resp.object == "response"
    assert resp.id.startswith("resp")
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in resp.output] == ["message"]
    assert resp.output_text
    assert resp.usage is not None
    expected_out = 8 - 2 if runtime == "sglang" else 8  # SGLang keeps 2 tokens of headroom
    assert resp.usage.output_tokens == expected_out
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.usage.input_tokens_details.cached_tokens >= 0
    assert resp.usage.output_tokens_details.reasoning_tokens == 0


async def test_message_items_and_instructions_render_like_chat(client: openai.AsyncOpenAI) -> None:
    """The Responses input renders to the same prompt tokens as the equivalent chat request."""
    items = cast(ResponseInputParam, [
        {"role": "user", "content": "Hi there"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello",
                                                               "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]},
    ])
    resp = await client.responses.create(model="tiny-moe", input=items, instructions="Be brief.", max_output_tokens=3)
    chat = await client.chat.completions.create(model="tiny-moe", max_tokens=3, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Tell me a story."},
    ])
    assert resp.usage is not None
    assert chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.instructions == "Be brief."


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_stream_event_sequence_on_the_wire(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime)
    events = await raw_stream(emu.url, {"model": "tiny-moe", "input": "Tell me about the sea.",
                                        "max_output_tokens": 6, "stream": True})
    types = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)  # each `event:` line names its payload
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    final = "response.incomplete" if runtime == "sglang" else "response.completed"  # cut by max_output_tokens
    assert collapse(types) == [*TEXT_EVENTS, final]
    deltas = [data["delta"] for name, data in events if name == "response.output_text.delta"]
    assert len(deltas) == (4 if runtime == "sglang" else 6)
    done = next(data for name, data in events if name == "response.output_text.done")
    assert done["text"] == "".join(deltas)
    ids = {data["response"]["id"] for name, data in events if "response" in data}
    assert len(ids) == 1
    last = events[-1][1]["response"]
    assert last["usage"]["output_tokens"] == len(deltas)
    assert last["output"][0]["content"][0]["text"] == done["text"]
    assert events[0][1]["response"]["status"] == "in_progress"


async def test_sdk_stream_helper_parses_the_stream(client: openai.AsyncOpenAI, runtime: str) -> None:
    # A JSON-schema output ends by itself (finish "stop"), so every runtime sends response.completed.
    async with client.responses.stream(
        model="tiny-moe", input="Weather?", max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "weather", "schema": PARAMS}},
    ) as stream:
        types, text = [], ""
        async for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = await stream.get_final_response()
    assert collapse(types) == [*TEXT_EVENTS, "response.completed"]
    assert final.status == "completed"
    assert final.output_text == text
    assert jsonschema_rs.validator_for(PARAMS).is_valid(json.loads(text))
    assert final.usage is not None
    assert final.usage.output_tokens > 0


@pytest.mark.parametrize("runtime", ["sglang"])
async def test_sglang_stream_cut_by_max_output_tokens_ends_incomplete(client: openai.AsyncOpenAI) -> None:
    """SGLang finishes a cut stream with `response.incomplete`, which the SDK's stream helper
    does not treat as final (`get_final_response` raises): clients must read the event."""
    async with client.responses.stream(model="tiny-moe", input="Tell me about the sea.",
                                       max_output_tokens=6) as stream:
        last = None
        async for event in stream:
            last = event
        assert last is not None
        assert last.type == "response.incomplete"
        assert last.response.status == "incomplete"
        with pytest.raises(RuntimeError):
            await stream.get_final_response()


async def test_forced_function_call(client: openai.AsyncOpenAI) -> None:
    choices: list[Any] = ["required", {"type": "function", "name": "get_weather"}]
    for choice in choices:
        resp = await client.responses.create(model="tiny-moe", input="What is the weather in Paris?", tools=[TOOL],
                                             tool_choice=choice, max_output_tokens=200)
        assert resp.status == "completed"
        assert [item.type for item in resp.output] == ["function_call"]
        call = resp.output[0]
        assert call.type == "function_call"
        assert call.name == "get_weather"
        assert call.status == "completed"
        assert call.call_id
        assert jsonschema_rs.validator_for(PARAMS).is_valid(json.loads(call.arguments))


async def test_forced_function_call_streams_argument_deltas(client: openai.AsyncOpenAI) -> None:
    async with client.responses.stream(model="tiny-moe", input="Weather?", tools=[TOOL], tool_choice="required",
                                       max_output_tokens=200) as stream:
        types, pieces = [], []
        async for event in stream:
            types.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                pieces.append(event.delta)
        final = await stream.get_final_response()
    assert collapse(types) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]
    assert len(pieces) > 1
    call = final.output[0]
    assert call.type == "function_call"
    assert call.arguments == "".join(pieces)
    assert jsonschema_rs.validator_for(PARAMS).is_valid(json.loads(call.arguments))


async def test_tool_choice_auto_answers_with_text(client: openai.AsyncOpenAI) -> None:
    resp = await client.responses.create(model="tiny-moe", input="Hi", tools=[TOOL], max_output_tokens=5)
    assert [item.type for item in resp.output] == ["message"]
    assert resp.tool_choice == "auto"


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_responses_share_the_prefix_cache_with_chat(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime)
    client = client_for(emu.url)
    long = "You are a careful assistant for an online bookshop. " * 12
    chat = await client.chat.completions.create(
        model="tiny-moe", max_tokens=2,
        messages=[{"role": "system", "content": long}, {"role": "user", "content": "Hi"}])
    resp = await client.responses.create(model="tiny-moe", instructions=long, input="Hi", max_output_tokens=2)
    assert resp.usage is not None
    assert chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    cached = resp.usage.input_tokens_details.cached_tokens
    assert cached > 0
    if runtime != "sglang":  # block-granular caches hit whole blocks only
        assert cached % emu.ctx.params.block_size == 0
    await client.close()


@pytest.mark.parametrize("runtime", ["sglang", "trtllm"])
async def test_stored_responses_continue_with_previous_response_id(client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(model="tiny-moe", input="Tell me about the sea.", max_output_tokens=4)
    again = await client.responses.retrieve(first.id)
    assert again.id == first.id
    assert again.output_text == first.output_text
    follow = await client.responses.create(model="tiny-moe", input="And the sky?", max_output_tokens=4,
                                           previous_response_id=first.id)
    alone = await client.responses.create(model="tiny-moe", input="And the sky?", max_output_tokens=4)
    assert follow.usage is not None
    assert alone.usage is not None
    assert first.usage is not None
    assert follow.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="tiny-moe", input="x", previous_response_id="resp_missing")


@pytest.mark.parametrize("runtime", ["vllm"])
async def test_vllm_has_no_response_store_by_default(client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(model="tiny-moe", input="Tell me about the sea.", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError) as err:
        await client.responses.retrieve(first.id)
    assert f"Response with id '{first.id}' not found." in str(err.value)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="tiny-moe", input="x", previous_response_id=first.id)


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_bad_requests_are_openai_shaped_4xx(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime, max_model_len=256)
    bad: list[dict[str, Any]] = [{"model": "tiny-moe"}, {"model": "tiny-moe", "input": "word " * 400},
                                 {"model": "tiny-moe", "input": 7}]
    if runtime == "vllm":  # vLLM checks the model and refuses max_output_tokens past max_model_len
        bad += [{"model": "nope", "input": "x"}, {"model": "tiny-moe", "input": "x", "max_output_tokens": 9000}]
    if runtime == "trtllm":  # its pydantic request model forbids extra fields
        bad += [{"model": "tiny-moe", "input": "x", "frobnicate": 1}]
    async with aiohttp.ClientSession() as s:
        for body in bad:
            async with s.post(emu.url + "/v1/responses", json=body) as r:
                assert 400 <= r.status < 500, (body, r.status)
                err = await r.json()
                assert "error" in err or "message" in err or "detail" in err, err
        if runtime != "vllm":  # SGLang and trtllm-serve clamp the budget to the context instead
            async with s.post(emu.url + "/v1/responses",
                              json={"model": "tiny-moe", "input": "x", "max_output_tokens": 9000}) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["output_tokens"] <= 256
