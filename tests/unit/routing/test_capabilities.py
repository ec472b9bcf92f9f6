"""What a request needs (`routing.capabilities.needs`) and what a backend lacks to serve it: pure."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from backends.base import Endpoint, Runtime
from backends.capabilities import GENERATE_DEFAULTS, Feature, resolve
from gateway.routing.capabilities import Needs, blocking, bridged, lacking, needs

F = Feature
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, set()),
    ({"tools": [TOOL]}, {F.TOOLS}),
    ({"tools": []}, set()),
    ({"tool_choice": "required"}, {F.TOOLS}),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, {F.TOOLS}),
    ({"functions": [{"name": "f"}]}, {F.TOOLS}),
    ({"response_format": {"type": "json_object"}}, {F.RESPONSE_FORMAT}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, {F.RESPONSE_FORMAT}),
    ({"response_format": {"type": "text"}}, set()),
    ({"logprobs": True}, {F.LOGPROBS}),
    ({"logprobs": False, "top_logprobs": 0}, set()),
    ({"top_logprobs": 3}, {F.LOGPROBS}),
    ({"n": 2}, {F.N}),
    ({"n": 1}, set()),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]}, {F.IMAGES}),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, {F.AUDIO}),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]}, {F.IMAGES}),
])
def test_chat_needs(extra: dict[str, Any], expected: set[Feature]) -> None:
    need = needs({"model": "m", "messages": USER, **extra}, Endpoint.CHAT)
    assert need.serves == (F.CHAT,)
    assert need.features == expected


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, set()), ({"logprobs": 0}, {F.LOGPROBS}), ({"logprobs": 2}, {F.LOGPROBS}), ({"n": 3}, {F.N}),
    ({"best_of": 2}, {F.N}),
])
def test_completions_needs(extra: dict[str, Any], expected: set[Feature]) -> None:
    assert needs({"model": "m", "prompt": "x", **extra}, Endpoint.COMPLETIONS).features == expected


@pytest.mark.parametrize(("extra", "serves", "expected"), [
    ({}, (F.RESPONSES, F.CHAT), set()),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, (F.RESPONSES, F.CHAT), {F.TOOLS}),
    ({"tools": [{"type": "web_search"}]}, (F.RESPONSES,), {F.TOOLS}),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, (F.RESPONSES, F.CHAT),
     {F.RESPONSE_FORMAT}),
    ({"previous_response_id": "resp_1"}, (F.RESPONSES,), {F.STORED_RESPONSES}),
    ({"top_logprobs": 2}, (F.RESPONSES,), {F.LOGPROBS}),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]},
     (F.RESPONSES, F.CHAT), {F.IMAGES}),
    ({"input": [{"type": "reasoning", "summary": []}]}, (F.RESPONSES,), set()),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, (F.RESPONSES,), set()),
])
def test_responses_needs(extra: dict[str, Any], serves: tuple[Feature, ...], expected: set[Feature]) -> None:
    need = needs({"model": "m", "input": "hi", **extra}, Endpoint.RESPONSES)
    assert need.serves == serves
    assert need.features == expected
    assert (need.untranslatable is None) == (len(serves) == 2)


@pytest.mark.parametrize(("endpoint", "feature"), [
    (Endpoint.EMBEDDINGS, F.EMBEDDINGS), (Endpoint.TOKENIZE, F.TOKENIZE), (Endpoint.DETOKENIZE, F.TOKENIZE)])
def test_other_endpoints_need_only_themselves(endpoint: Endpoint, feature: Feature) -> None:
    assert needs({"model": "m"}, endpoint) == Needs(endpoint, (feature,))


_OPTIONAL = (F.TOOLS, F.RESPONSE_FORMAT, F.LOGPROBS, F.N, F.IMAGES, F.AUDIO)


@pytest.mark.parametrize("size", [0, 1, 2, 3])
def test_a_backend_lacks_exactly_what_it_does_not_have(size: int) -> None:
    """For every combination of needed features and every one feature removed from a full set of
    capabilities, the backend lacks that feature iff the request needs it."""
    full = frozenset(Feature)
    for wanted in itertools.combinations(_OPTIONAL, size):
        need = Needs(Endpoint.CHAT, (F.CHAT,), frozenset(wanted))
        assert lacking(full, need) == ()
        for removed in Feature:
            gap = lacking(full - {removed}, need)
            assert gap == ((removed,) if removed in wanted or removed is F.CHAT else ())


def test_triton_serves_plain_chat_and_responses_only_through_chat() -> None:
    triton = resolve(Runtime.TRITON, embeddings=False, overrides={})
    chat = needs({"model": "m", "messages": USER}, Endpoint.CHAT)
    tools = needs({"model": "m", "messages": USER, "tools": [TOOL]}, Endpoint.CHAT)
    response = needs({"model": "m", "input": "hi"}, Endpoint.RESPONSES)
    stored = needs({"model": "m", "input": "hi", "previous_response_id": "resp_1"}, Endpoint.RESPONSES)
    assert lacking(triton, chat) == ()
    assert lacking(triton, tools) == (F.TOOLS,)
    assert lacking(triton, response) == ()
    assert bridged(triton, response)
    assert lacking(triton, stored) == (F.RESPONSES, F.STORED_RESPONSES)
    vllm = GENERATE_DEFAULTS[Runtime.VLLM]
    assert lacking(vllm, response) == ()
    assert not bridged(vllm, response)
    assert lacking(vllm, stored) == (F.STORED_RESPONSES,)  # vLLM keeps no responses by default
    assert lacking(GENERATE_DEFAULTS[Runtime.SGLANG], stored) == ()


def test_overrides_add_and_remove_and_refuse_the_impossible() -> None:
    caps = resolve(Runtime.VLLM, embeddings=False, overrides={F.TOOLS: False, F.STORED_RESPONSES: True})
    assert F.TOOLS not in caps
    assert F.STORED_RESPONSES in caps
    assert resolve(Runtime.VLLM, embeddings=True, overrides={}) == {F.EMBEDDINGS, F.TOKENIZE}
    assert resolve(Runtime.TRTLLM, embeddings=True, overrides={}) == {F.EMBEDDINGS}
    with pytest.raises(ValueError, match="tools"):
        resolve(Runtime.TRITON, embeddings=False, overrides={F.TOOLS: True})


def test_the_blocking_feature_is_one_every_backend_lacks() -> None:
    assert blocking([(F.TOOLS, F.STORED_RESPONSES), (F.STORED_RESPONSES,)]) == F.STORED_RESPONSES
    assert blocking([(F.TOOLS,), (F.IMAGES,)]) == F.TOOLS
