"""`rewrite_model` reads compact bodies in place (`_read_in_place`): for every JSON body it answers
exactly what parsing the whole body answers, or leaves the body to the full parse."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import Usage
from backends.openai_compat import _read_in_place, _rewrite_parsed, rewrite_model

USAGE = {"prompt_tokens": 24, "total_tokens": 36, "completion_tokens": 12,
         "prompt_tokens_details": {"cached_tokens": 4}}
CHAT = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny-moe",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}],
        "usage": USAGE, "prompt_logprobs": None, "kv_transfer_params": None}


def body(obj: Any) -> bytes:
    return orjson.dumps(obj)


CASES = {
    "vllm chat": body(CHAT),
    "same model": body({**CHAT, "model": "moe"}),
    "usage first": body({"usage": USAGE, **CHAT}),
    "no usage": body({k: v for k, v in CHAT.items() if k != "usage"}),
    "null usage": body({**CHAT, "usage": None}),
    "usage in a choice only": body({**{k: v for k, v in CHAT.items() if k != "usage"},
                                    "choices": [{"index": 0, "usage": USAGE}]}),
    "usage in a choice after the top one": body({**CHAT, "metrics": {"usage": {"prompt_tokens": 1}}}),
    "usage and model in text": body({**CHAT, "choices": [{"message": {"content": 'x "usage": {}, "model": "y"'}}]}),
    "a key ending in an escaped quote": body({**CHAT, "choices": [{"logprobs": {'\\"usage': 1}}]}),
    "model after a nested object": body({"id": "x", "choices": [], "model": "tiny-moe", "usage": USAGE}),
    "model in an object before the top one": body({"meta": {"model": "a"}, "model": "tiny-moe"}),
    "nested model only": body({"choices": [{"model": "tiny-moe"}], "usage": USAGE}),
    "escaped model": body({**CHAT, "model": 'tiny"moe'}),
    "unicode model": body({**CHAT, "model": "tiny-mœ"}),
    "model not a string": body({**CHAT, "model": None}),
    "spaced": b'{"id": "x", "model": "tiny-moe", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}',
    "pretty": orjson.dumps(CHAT, option=orjson.OPT_INDENT_2),
    "tokenize": b'{"count":2,"max_model_len":2048,"tokens":[1,2],"token_strs":null}',
    "array": body([CHAT]),
    "not json": b"upstream says hi",
    "empty": b"",
    "brace in the id": body({**CHAT, "id": "{x"}),
}


@pytest.mark.parametrize("raw", CASES.values(), ids=CASES.keys())
def test_in_place_answers_what_the_full_parse_answers(raw: bytes) -> None:
    assert rewrite_model(raw, "moe") == _rewrite_parsed(raw, "moe")


def test_the_benchmark_answer_takes_the_fast_path() -> None:
    reply = _read_in_place(CASES["vllm chat"], "moe")
    assert reply is not None
    assert reply.usage == Usage(24, 12, 4)
    assert orjson.loads(reply.body) == {**CHAT, "model": "moe"}


def test_bodies_it_cannot_prove_go_to_the_full_parse() -> None:
    for name in ("usage in a choice only", "usage in a choice after the top one", "model after a nested object",
                 "escaped model", "pretty", "array", "model in an object before the top one"):
        assert _read_in_place(CASES[name], "moe") is None, name


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.sampled_from(["model", "usage", '"usage":', "{", "[", "\\"]),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["model", "usage", "prompt_tokens", "completion_tokens", "x", '\\"usage']),
                      inner, max_size=4),
    max_leaves=12,
)


USAGES = st.fixed_dictionaries({}, optional={"prompt_tokens": st.integers(0, 9), "completion_tokens": st.integers(0, 9),
                                             "prompt_tokens_details": JSON})
# answer-shaped objects: the keys the fast path looks for, in any order, with anything in between
ANSWERS = st.fixed_dictionaries({}, optional={
    "id": JSON, "model": st.sampled_from(["tiny-moe", "moe", 'a"b', "mœ"]) | JSON, "choices": JSON,
    "usage": USAGES | JSON, "x": JSON,
}).flatmap(lambda d: st.permutations(list(d.items())).map(dict))


@settings(max_examples=400, deadline=None)
@given(JSON | ANSWERS, st.sampled_from(["tiny-moe", "moe"]))
def test_any_json_is_answered_as_the_full_parse_answers(obj: Any, model: str) -> None:
    raw = orjson.dumps(obj)
    assert rewrite_model(raw, model) == _rewrite_parsed(raw, model)
