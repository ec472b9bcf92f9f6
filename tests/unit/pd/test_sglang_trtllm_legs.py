"""SGLang's and trtllm-serve's legs as pure body transforms (`backends.disaggregation`)."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from backends.disaggregation import (
    sglang_bodies,
    sglang_room,
    trtllm_context_body,
    trtllm_generation_body,
    trtllm_handoff,
)

CLIENT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 8,
          "stream_options": {"include_usage": True}}


RANKED = st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1)))


@given(st.integers(0, (1 << 63) - 1), RANKED)
def test_a_room_is_in_range_and_follows_the_prefill_rank(bits: int, sized: tuple[int, int]) -> None:
    size, rank = sized
    room = sglang_room(bits, rank, size)
    assert 0 <= room < 1 << 63
    assert room % size == rank


def test_without_ranks_the_room_is_the_random_bits() -> None:
    assert sglang_room(12345, None, 1) == 12345


def test_both_sglang_legs_carry_the_rendezvous_and_only_the_decode_streams() -> None:
    prefill, decode = sglang_bodies(CLIENT, host="10.0.0.1", port=8998, room=42, prefill_rank=1)
    for body in (prefill, decode):
        assert (body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]) == ("10.0.0.1", 8998, 42)
    assert prefill["stream"] is False
    assert "stream_options" not in prefill
    assert "disagg_prefill_dp_rank" not in prefill
    assert decode["stream"] is True
    assert decode["disagg_prefill_dp_rank"] == 1
    _, alone = sglang_bodies(CLIENT, host="h", port=1, room=0, prefill_rank=None)
    assert "disagg_prefill_dp_rank" not in alone


def test_trtllm_context_leg_then_generation_leg() -> None:
    ctx = trtllm_context_body(CLIENT)
    assert ctx["disaggregated_params"] == {"request_type": "context_only"}
    assert ctx["stream"] is False
    assert "stream_options" not in ctx
    params = {"request_type": "context_only", "ctx_request_id": 7, "encoded_opaque_state": "b64",
              "first_gen_tokens": [3]}
    answer = orjson.dumps({"choices": [{"index": 0, "finish_reason": "not_finished", "disaggregated_params": params}]})
    assert trtllm_handoff(answer) == ("ok", params, False)
    gen = trtllm_generation_body(CLIENT, params)
    assert gen["disaggregated_params"] == {**params, "request_type": "generation_only"}
    assert gen["stream"] is True
    assert trtllm_generation_body({**CLIENT, "disaggregated_params": {"x": 1}}, None) == CLIENT


def test_a_finished_context_answer_is_the_whole_answer() -> None:
    done = orjson.dumps({"choices": [{"finish_reason": "stop", "disaggregated_params": None}]})
    assert trtllm_handoff(done) == ("null", None, True)
    assert trtllm_handoff(orjson.dumps({"choices": [{"finish_reason": "length"}]})) == ("missing", None, False)
    assert trtllm_handoff(b"{}") == ("invalid", None, False)
