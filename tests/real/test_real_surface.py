"""Issue 16 against the real vLLM 0.32 CPU server, through the gateway, with the official SDK: forced
tool calls (required and named, streamed and not) parsed into `tool_calls`, JSON-schema outputs that
validate, `client.responses.create` and `client.responses.stream`, tokenize, and the tokens the
gateway counts equal to the usage the client saw.

With `"strict": true` on the function and `parallel_tool_calls: false`, vLLM's guided decoding makes
even the random tiny model emit a valid call (in 70-100 tokens); the schema uses enums because a
random model never closes a free string."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from jsonschema_rs import validate
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from prometheus_client.parser import text_string_to_metric_families

from .harness import BACKEND_NAME, MAX_MODEL_LEN, ROUTE_MODEL

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

PARAMS: dict[str, Any] = {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "unit": {"type": "string", "enum": ["c", "f"]}}}
TOOLS: list[ChatCompletionToolParam] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city", "parameters": PARAMS, "strict": True}}]
WEATHER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]


def counted(http: httpx.Client) -> tuple[float, float]:
    """The gateway's prompt and completion tokens for the real backend so far."""
    totals = {"prompt": 0.0, "completion": 0.0}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == "gateway_tokens_total" and s.labels.get("backend") == BACKEND_NAME \
                    and s.labels.get("kind") in totals:
                totals[s.labels["kind"]] += s.value
    return totals["prompt"], totals["completion"]


@pytest.fixture
def tokens(http: httpx.Client) -> Iterator[list[tuple[int, int]]]:
    """Usage the client saw, appended by the test: on exit the gateway must have counted exactly it."""
    before = counted(http)
    seen: list[tuple[int, int]] = []
    yield seen
    after = counted(http)
    assert (after[0] - before[0], after[1] - before[1]) == (sum(p for p, _ in seen), sum(c for _, c in seen))


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_are_parsed_by_the_sdk(client: openai.OpenAI, tokens: list[tuple[int, int]],
                                                 choice: str) -> None:
    tool_choice: Any = "required" if choice == "required" else {"type": "function",
                                                                  "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=ROUTE_MODEL, messages=WEATHER, tools=TOOLS, tool_choice=tool_choice,
                                           parallel_tool_calls=False, max_tokens=200)
    calls = reply.choices[0].message.tool_calls
    assert calls is not None
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function"
    assert call.function.name == "get_weather"
    validate(PARAMS, json.loads(call.function.arguments))
    assert reply.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert reply.usage is not None
    tokens.append((reply.usage.prompt_tokens, reply.usage.completion_tokens))


@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_forced_tool_calls_assemble_into_a_valid_call(
    client: openai.OpenAI, tokens: list[tuple[int, int]], choice: str
) -> None:
    tool_choice: Any = "required" if choice == "required" else {"type": "function",
                                                                  "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(model=ROUTE_MODEL, messages=WEATHER, tools=TOOLS, tool_choice=tool_choice,
                                            parallel_tool_calls=False, max_tokens=200, stream=True,
                                            stream_options={"include_usage": True})
    names, arguments, usage = [], "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            for call in c.delta.tool_calls or ():
                if call.function is not None:
                    names += [call.function.name] if call.function.name else []
                    arguments += call.function.arguments or ""
    assert names == ["get_weather"]
    validate(PARAMS, json.loads(arguments))
    assert usage is not None
    tokens.append((usage.prompt_tokens, usage.completion_tokens))


def test_json_schema_output_validates(client: openai.OpenAI, tokens: list[tuple[int, int]]) -> None:
    reply = client.chat.completions.create(
        model=ROUTE_MODEL, messages=WEATHER, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": PARAMS, "strict": True}})
    validate(PARAMS, json.loads(reply.choices[0].message.content or ""))
    assert reply.usage is not None
    tokens.append((reply.usage.prompt_tokens, reply.usage.completion_tokens))


def test_responses_create(client: openai.OpenAI, tokens: list[tuple[int, int]]) -> None:
    raw = client.responses.with_raw_response.create(model=ROUTE_MODEL, input="Tell me about the sea.",
                                                    instructions="Be brief.", max_output_tokens=12)
    resp = raw.parse()
    assert raw.headers["x-gateway-backend"] == BACKEND_NAME
    assert resp.model == ROUTE_MODEL
    assert resp.output_text
    assert resp.usage is not None
    assert 1 <= resp.usage.output_tokens <= 12
    tokens.append((resp.usage.input_tokens, resp.usage.output_tokens))


def test_responses_stream(client: openai.OpenAI, tokens: list[tuple[int, int]]) -> None:
    with client.responses.stream(model=ROUTE_MODEL, input="Tell me about the sea.", max_output_tokens=10) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.model == ROUTE_MODEL
    assert final.output_text == text
    assert final.usage is not None
    tokens.append((final.usage.input_tokens, final.usage.output_tokens))


def test_responses_forced_tool_call(client: openai.OpenAI, tokens: list[tuple[int, int]]) -> None:
    resp = client.responses.create(
        model=ROUTE_MODEL, input="What is the weather in Paris?", max_output_tokens=200, tool_choice="required",
        parallel_tool_calls=False, tools=[{"type": "function", "name": "get_weather", "parameters": PARAMS,
                                           "strict": True}])
    [call] = [o for o in resp.output if o.type == "function_call"]
    assert call.name == "get_weather"
    validate(PARAMS, json.loads(call.arguments))
    assert resp.usage is not None
    tokens.append((resp.usage.input_tokens, resp.usage.output_tokens))


def test_tokenize_and_models(http: httpx.Client, tokens: list[tuple[int, int]]) -> None:
    resp = http.post("/tokenize", json={"model": ROUTE_MODEL, "prompt": "Hello world"})
    assert resp.status_code == 200
    body = resp.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"model": ROUTE_MODEL, "tokens": body["tokens"]}).json()["prompt"]
    assert "world" in text
    [card] = [m for m in http.get("/v1/models").json()["data"] if m["id"] == ROUTE_MODEL]
    assert card["max_model_len"] == MAX_MODEL_LEN  # scraped from vLLM's own /v1/models
