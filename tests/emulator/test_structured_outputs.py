"""Forced tool calls and JSON `response_format` on the OpenAI faces (issue 16): what the official
SDK parses is a valid call whose arguments validate against the function's schema, streamed as the
runtime streams it; and the minimal-instance generator behind it, checked with a real validator."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import jsonschema_rs
import openai
import pytest
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)

from backends.emulator.schema_instance import instance
from tests.emulator.conftest import MakeEmulator

RUNTIMES = ["vllm", "sglang", "trtllm"]
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 3, "maximum": 9},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "note": {"type": "string", "minLength": 4},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "when": {"$ref": "#/$defs/slot"},
    },
    "required": ["city", "days", "note", "tags", "when"],
    "$defs": {"slot": {"type": "object", "properties": {"hour": {"type": "number", "exclusiveMinimum": 0.5}},
                       "required": ["hour"], "additionalProperties": False}},
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}},
]


def valid(schema: dict[str, Any], text: str) -> bool:
    return bool(jsonschema_rs.validator_for(schema).is_valid(json.loads(text)))


SCHEMAS: list[dict[str, Any]] = [
    PARAMS,
    {"type": "string", "format": "date-time"},
    {"type": "integer", "exclusiveMinimum": 10, "multipleOf": 5},
    {"type": "number", "minimum": -2.5, "maximum": -1},
    {"type": "string", "minLength": 3, "maxLength": 3},
    {"const": {"a": [1, 2]}},
    {"anyOf": [{"type": "null"}, {"type": "integer"}]},
    {"oneOf": [{"type": "boolean"}, {"type": "string"}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    {"type": ["null", "array"], "items": {"enum": [3, 4]}, "minItems": 3},
    {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x", "y"],
     "additionalProperties": {"type": "integer"}},
    {"type": "object", "minProperties": 2, "additionalProperties": {"type": "boolean"}},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "minItems": 2},
    {"definitions": {"n": {"type": "object", "properties": {"next": {"$ref": "#/definitions/n"}}}},
     "$ref": "#/definitions/n"},
    {},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: json.dumps(s)[:40])
def test_minimal_instance_validates(schema: dict[str, Any]) -> None:
    value = instance(schema)
    assert jsonschema_rs.validator_for(schema).is_valid(value), value
    assert instance(schema) == value  # deterministic


def test_minimal_instance_uses_required_properties_only() -> None:
    value = instance(PARAMS)
    assert set(value) == {"city", "days", "note", "tags", "when"}
    assert value["city"] == "Paris"
    assert value["days"] == 3
    assert len(value["tags"]) == 2


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_forced_tool_call_required_and_named(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime)
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    named = await client.chat.completions.create(
        model="tiny-moe", messages=MSG, tools=TOOLS, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = named.choices[0]
    assert choice.message.tool_calls is not None
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert valid(PARAMS, call.function.arguments)
    assert named.usage is not None
    assert named.usage.completion_tokens > 0

    required = await client.chat.completions.create(
        model="tiny-moe", messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=200,
    )
    rchoice = required.choices[0]
    assert rchoice.message.tool_calls is not None
    rcall = rchoice.message.tool_calls[0]
    assert isinstance(rcall, ChatCompletionMessageFunctionToolCall)
    assert rcall.function.name in {"get_time", "get_weather"}
    assert json.loads(rcall.function.arguments) is not None
    if runtime == "vllm":  # as captured (chat_tool_required / chat_tool_named)
        assert rchoice.finish_reason == "tool_calls"
        assert choice.finish_reason == "stop"
        assert rchoice.message.content == ""
        assert choice.message.content == ""
        assert call.id.startswith("chatcmpl-tool-")
    else:
        assert rchoice.finish_reason == "tool_calls"
    await client.close()


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("choice", ["required", "named"])
async def test_forced_tool_call_streams_argument_pieces(emulator: MakeEmulator, runtime: str, choice: str) -> None:
    emu = await emulator(runtime)
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    tool_choice: Any = "required" if choice == "required" else {"type": "function",
                                                                "function": {"name": "get_weather"}}
    stream = await client.chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS[1:],
        tool_choice=tool_choice, max_tokens=200, stream=True, stream_options={"include_usage": True},
    )
    names, pieces, ids, finish, usage = [], [], set(), None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            if tc.id:
                ids.add(tc.id)
            if tc.function and tc.function.name:
                names.append(tc.function.name)
            if tc.function and tc.function.arguments:
                pieces.append(tc.function.arguments)
    assert names == ["get_weather"]
    assert len(ids) == 1
    assert len(pieces) > 1  # arguments arrive in pieces, one per generated token
    assert valid(PARAMS, "".join(pieces))
    assert finish in {"tool_calls", "stop"}
    assert usage is not None
    assert usage.completion_tokens >= len(pieces)
    await client.close()


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_response_format_json_object_and_schema(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime)
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    obj = await client.chat.completions.create(model="tiny-moe", messages=MSG, max_tokens=50,
                                               response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    sch = await client.chat.completions.create(
        model="tiny-moe", messages=MSG, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": PARAMS}},
    )
    assert valid(PARAMS, sch.choices[0].message.content or "")
    assert sch.choices[0].finish_reason == "stop"
    stream = await client.chat.completions.create(
        model="tiny-moe", messages=MSG, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": PARAMS}},
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert valid(PARAMS, text)
    await client.close()


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_tool_choice_auto_and_none_answer_with_text(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime)
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    for tool_choice in ("auto", "none"):
        reply = await client.chat.completions.create(model="tiny-moe", messages=MSG, tools=TOOLS,
                                                     tool_choice=tool_choice, max_tokens=5)
        assert reply.choices[0].message.content
        assert not reply.choices[0].message.tool_calls
    await client.close()


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_named_tool_that_is_not_declared_is_a_400(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime)
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="tiny-moe", messages=MSG, tools=TOOLS, max_tokens=5,
                                             tool_choice={"type": "function", "function": {"name": "nope"}})
    await client.close()


async def test_triton_generate_refuses_tools_and_ignores_sampling_extras(emulator: MakeEmulator) -> None:
    """Triton's generate endpoint maps JSON keys onto model inputs and parameters: an object- or
    array-valued key that is not an input is refused; scalars it does not know are ignored."""
    emu = await emulator("triton")
    url = emu.url + "/v2/models/tiny-moe/generate"
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json={"text_input": "hi", "max_tokens": 3, "tools": [{"type": "function"}]}) as r:
            assert r.status == 400
            body = await r.json()
            assert set(body) == {"error"}
            assert "tools" in body["error"]
        async with s.post(url, json={"text_input": "hi", "max_tokens": 3,
                                     "response_format": {"type": "json_object"}}) as r:
            assert r.status == 400
            assert "response_format" in (await r.json())["error"]
        async with s.post(url, json={"text_input": "hi", "max_tokens": 3, "logprobs": 2, "n": 4}) as r:
            assert r.status == 200
            out = await r.json()
            assert out["text_output"]
            assert "logprobs" not in out


async def test_vllm_tool_choice_errors_are_its_validation_errors(emulator: MakeEmulator) -> None:
    """Worded as vLLM 0.32's `check_tool_usage` (chat and Responses protocols) raises them; a
    VLLMValidationError's str() appends the parameter."""
    emu = await emulator("vllm")
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {"messages": MSG, "tool_choice": "required"},
         "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)"),
        ("/v1/chat/completions", {"messages": MSG, "tools": TOOLS,
                                  "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "The tool specified in `tool_choice` does not match any of the specified `tools` (parameter=tool_choice)"),
        ("/v1/responses", {"input": "x", "tool_choice": "required"},
         "Tool choice 'required' must be specified with 'tools' parameter. (parameter=tool_choice)"),
        ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}],
                           "tool_choice": {"type": "function", "name": "g"}},
         "Tool choice 'function' not found in 'tools' parameter. (parameter=tool_choice)"),
    ]
    async with aiohttp.ClientSession() as s:
        for path, body, message in cases:
            async with s.post(emu.url + path, json={"model": "tiny-moe", **body}) as r:
                assert r.status == 400
                assert await r.json() == {"error": {"message": message, "type": "BadRequestError",
                                                    "param": "tool_choice", "code": 400}}
