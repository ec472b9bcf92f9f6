"""vLLM's two legs as pure body transforms (`backends.disaggregation`)."""

from __future__ import annotations

import orjson
import pytest

from backends.disaggregation import PREFILL_ONLY, vllm_decode_body, vllm_handoff, vllm_prefill_body

CLIENT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 64,
          "stream_options": {"include_usage": True}, "min_tokens": 4, "n": 2, "temperature": 0.3,
          "max_completion_tokens": 64}
NIXL = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e-1", "remote_block_ids": [1, 2],
        "remote_request_id": "r-1", "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1}


def test_leg_one_is_prefill_only_one_token_unstreamed() -> None:
    leg = vllm_prefill_body(CLIENT)
    assert leg["kv_transfer_params"] == PREFILL_ONLY
    assert (leg["max_tokens"], leg["max_completion_tokens"], leg["n"], leg["stream"]) == (1, 1, 1, False)
    assert "stream_options" not in leg
    assert "min_tokens" not in leg
    assert (leg["temperature"], leg["messages"]) == (0.3, CLIENT["messages"])
    assert "max_output_tokens" not in leg  # only where the client gave it
    assert CLIENT["max_tokens"] == 64  # the client's body is not changed


def test_leg_two_is_the_clients_body_with_the_params_verbatim() -> None:
    leg = vllm_decode_body({**CLIENT, "kv_transfer_params": {"forged": True}}, NIXL)
    assert leg == {**CLIENT, "kv_transfer_params": NIXL}
    assert vllm_decode_body({**CLIENT, "kv_transfer_params": {"forged": True}}, None) == CLIENT


@pytest.mark.parametrize(("answer", "expected"), [
    (orjson.dumps({"id": "x", "kv_transfer_params": NIXL}), ("ok", NIXL)),
    (orjson.dumps({"id": "x", "kv_transfer_params": None}), ("null", None)),
    (orjson.dumps({"id": "x"}), ("missing", None)),
    (orjson.dumps({"id": "x", "kv_transfer_params": "yes"}), ("invalid", None)),
    (orjson.dumps({"id": "x", "kv_transfer_params": {}}), ("invalid", None)),
    (b"[1]", ("invalid", None)),
    (b"not json", ("invalid", None)),
])
def test_the_prefills_answer_says_what_it_hands_over(answer: bytes, expected: tuple[str, object]) -> None:
    assert vllm_handoff(answer) == expected
