"""trtllm-serve's context and generation legs (issue 23) over real sockets: a context-only leg
answering its `disaggregated_params` and keeping its KV, the generation-only leg loading it and
decoding without the prefill, a context that already finished, and generation legs whose KV is
gone."""

from __future__ import annotations

import string
from typing import Any

import httpx

from backends.emulator import DisaggConfig, RunningEmulator
from tests.emulator.conftest import MakeEmulator
from tests.polling import until

LONG = "Summarise the following text. " + "The quick brown fox jumps over the lazy dog. " * 30
BODY: dict[str, Any] = {"model": "tiny-moe", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4}
PARAM_KEYS = {"request_type", "first_gen_tokens", "ctx_request_id", "encoded_opaque_state", "draft_tokens",
              "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint"}


async def post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(url + "/v1/chat/completions", json=body)


def context_leg(**extra: Any) -> dict[str, Any]:
    """As trtllm's disaggregated server sends it: the client's body, context-only, not streamed."""
    return {**BODY, "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 7}, **extra}


def generation_leg(ctx_answer: dict[str, Any]) -> dict[str, Any]:
    params = {**ctx_answer["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    return {**BODY, "disaggregated_params": params, "prompt_token_ids": ctx_answer["prompt_token_ids"]}


async def pair(emulator: MakeEmulator) -> tuple[RunningEmulator, RunningEmulator]:
    c = await emulator("trtllm", disagg=DisaggConfig(role="prefill"))
    g = await emulator("trtllm", disagg=DisaggConfig(role="decode"))
    return c, g


async def test_context_then_generation_leg(emulator: MakeEmulator) -> None:
    c, g = await pair(emulator)
    leg1 = await post(c.url, context_leg())
    assert leg1.status_code == 200
    answer = leg1.json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "not_finished"
    params = choice["disaggregated_params"]
    assert set(params) == PARAM_KEYS
    assert params["request_type"] == "context_only"
    assert len(params["first_gen_tokens"]) == 1
    assert isinstance(params["ctx_request_id"], int)
    assert params["disagg_request_id"] == 7
    assert answer["usage"]["completion_tokens"] == 1
    assert len(answer["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]
    assert c.snapshot().kv_used_blocks > 0  # kept for the generation server

    leg2 = await post(g.url, generation_leg(answer))
    assert leg2.status_code == 200
    usage = leg2.json()["usage"]
    assert usage["completion_tokens"] == 4
    prompt = usage["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == min(prompt // 32 * 32, prompt - 1)
    assert g.stats.kv_pulled == 1
    await until(lambda: c.snapshot().kv_used_blocks == 0)


async def test_a_finished_context_answer_keeps_nothing(emulator: MakeEmulator) -> None:
    c, _ = await pair(emulator)
    stops = list(string.ascii_letters + string.digits + " ")  # the first token surely holds one: it stops there
    leg1 = await post(c.url, context_leg(stop=stops, max_tokens=8))
    choice = leg1.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # returned to the client as is: no generation leg
    assert choice["disaggregated_params"]["request_type"] == "context_only"
    assert c.stats.kv_produced == 0
    assert c.snapshot().kv_used_blocks == 0


async def test_a_generation_leg_without_its_kv_fails(emulator: MakeEmulator) -> None:
    c, g = await pair(emulator)
    answer = (await post(c.url, context_leg())).json()
    assert (await post(g.url, generation_leg(answer))).status_code == 200
    again = await post(g.url, generation_leg(answer))  # the context's KV was read once and freed
    assert again.status_code == 500
    assert again.json()["message"].startswith("KV cache transfer failed for ctx_request_id")
    garbled = generation_leg(answer)
    garbled["disaggregated_params"]["encoded_opaque_state"] = "not base64 json"
    assert (await post(g.url, garbled)).status_code == 500
    assert g.stats.pd_failed == 2


async def test_a_server_without_a_role_refuses_disaggregated_legs(emulator: MakeEmulator) -> None:
    plain = await emulator("trtllm")
    reply = await post(plain.url, context_leg())
    assert reply.status_code == 400
    assert "cache transceiver" in reply.json()["message"]
    c, _ = await pair(emulator)
    streamed = await post(c.url, context_leg(stream=True))
    assert streamed.status_code == 400
