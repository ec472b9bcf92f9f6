"""SGLang's prefill/decode legs (issue 23) over real sockets: one body to both servers, the decode
finding the prefill's rank through the bootstrap server and getting the KV of its room, the two
timeouts (a decode whose prefill never comes, a prefill whose decode never comes), the refusal of a
request without a room, and the DP ranks (the prefill's follows the room, the decode names the
prefill's with `disagg_prefill_dp_rank`)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from typing import Any

import httpx
import openai

from backends.emulator import DisaggConfig, RunningEmulator
from tests.emulator.conftest import MakeEmulator
from tests.polling import until

LONG = "Summarise the following text. " + "The quick brown fox jumps over the lazy dog. " * 30
BODY: dict[str, Any] = {"model": "tiny-moe", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4}


async def post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(url + "/v1/chat/completions", json=body)


def pd_body(prefill: RunningEmulator, room: int | None = None, **extra: Any) -> dict[str, Any]:
    """What SGLang's router sends to both legs."""
    return {**BODY, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(63) if room is None else room, **extra}


async def pair(
    emulator: MakeEmulator, *, dp: int = 1, waiting_timeout_s: float = 300.0, bootstrap_timeout_s: float = 300.0,
) -> tuple[RunningEmulator, RunningEmulator]:
    timeouts = DisaggConfig(waiting_timeout_s=waiting_timeout_s, bootstrap_timeout_s=bootstrap_timeout_s)
    p = await emulator("sglang", data_parallel_size=dp, disagg=replace(timeouts, role="prefill", bootstrap_port=0))
    d = await emulator("sglang", data_parallel_size=dp, disagg=replace(timeouts, role="decode"))
    return p, d


async def test_both_legs_meet_in_the_room_and_the_decode_skips_the_prefill(emulator: MakeEmulator) -> None:
    p, d = await pair(emulator)
    body = pd_body(p)
    leg_p, leg_d = await asyncio.gather(post(p.url, body), post(d.url, body))
    assert leg_p.status_code == 200
    assert leg_p.json()["usage"]["completion_tokens"] == 1  # the prefill computes the prompt and one token
    assert leg_d.status_code == 200
    usage = leg_d.json()["usage"]
    assert usage["completion_tokens"] == 4
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1  # all but the last token
    assert (p.stats.kv_produced, d.stats.kv_pulled) == (1, 1)
    assert d.stats.kv_pulled_tokens == usage["prompt_tokens"]
    assert p.snapshot().kv_used_blocks == 0  # the send buffer is freed after the transfer


async def test_either_leg_may_arrive_first(emulator: MakeEmulator) -> None:
    p, d = await pair(emulator)
    first_p = pd_body(p)
    task = asyncio.create_task(post(p.url, first_p))
    await until(lambda: bool(p.ctx.sglang_kv[0]._registered))  # the prefill waits in its bootstrap queue
    assert (await post(d.url, first_p)).status_code == 200
    assert (await task).status_code == 200

    first_d = pd_body(p)
    task = asyncio.create_task(post(d.url, first_d))
    await until(lambda: first_d["bootstrap_room"] in p.ctx.sglang_kv[0].registrations)
    assert (await post(p.url, first_d)).status_code == 200
    assert (await task).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_streamed_decode_leg_through_the_official_client(emulator: MakeEmulator) -> None:
    p, d = await pair(emulator)
    body = pd_body(p)
    extra = {k: body[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
    prefill = asyncio.create_task(post(p.url, body))
    async with openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="unused") as client:
        stream = await client.chat.completions.create(
            model="tiny-moe", messages=BODY["messages"], max_tokens=4, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        chunks = [c async for c in stream]
    assert (await prefill).status_code == 200
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 4
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


async def test_a_request_without_a_room_is_refused_by_both(emulator: MakeEmulator) -> None:
    p, d = await pair(emulator)
    for emu in (p, d):
        reply = await post(emu.url, BODY)
        assert reply.status_code == 400
        assert reply.json()["message"] == "Disaggregated request received without bootstrap room id"
    aggregated = await emulator("sglang", disagg=DisaggConfig(role="both"))  # SGLang's null mode
    assert (await post(aggregated.url, pd_body(p))).status_code == 200


async def test_a_decode_whose_prefill_never_comes_times_out(emulator: MakeEmulator) -> None:
    p, d = await pair(emulator, waiting_timeout_s=0.3)
    body = pd_body(p)
    reply = await post(d.url, body)
    assert reply.status_code == 500
    room = body["bootstrap_room"]
    message = reply.json()["message"]
    assert message.startswith("Decode transfer failed for request rank=0 decode_req.req.rid=")
    assert f"KVTransferError(bootstrap_room={room}): Request {room} timed out after 0." in message
    assert message.endswith("s in KVPoll.WaitingForInput")
    assert d.stats.pd_failed == 1
    assert d.snapshot().waiting == 0
    await until(lambda: room not in p.ctx.sglang_kv[0].registrations)  # the decode's ABORT reached the prefill


async def test_a_prefill_whose_decode_never_comes_times_out(emulator: MakeEmulator) -> None:
    p, _ = await pair(emulator, bootstrap_timeout_s=0.3)
    body = pd_body(p)
    reply = await post(p.url, body)
    assert reply.status_code == 500
    room = body["bootstrap_room"]
    message = reply.json()["message"]
    assert message.startswith("Prefill bootstrap failed for request rank=0 req.rid=")
    assert f"Request {room} timed out after 0." in message
    assert message.endswith("s in KVPoll.Bootstrapping")
    assert p.stats.pd_failed == 1
    assert p.stats.completed == 0  # nothing was computed


async def test_a_decode_that_cannot_reach_the_bootstrap_server_fails(emulator: MakeEmulator) -> None:
    p, d = await pair(emulator)
    reply = await post(d.url, {**pd_body(p), "bootstrap_port": 1})
    assert reply.status_code == 500
    assert "Decode handshake failed" in reply.json()["message"]
    assert "Could not fetch prefill parallel info" in reply.json()["message"]


async def test_the_bootstrap_server_answers_like_sglangs(emulator: MakeEmulator) -> None:
    p, _ = await pair(emulator, dp=2)
    base = f"http://127.0.0.1:{p.bootstrap_port}"
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(base + "/health")).text == "OK"
        info = (await c.get(base + "/route", params={"prefill_dp_rank": "-1", "prefill_cp_rank": "-1",
                                                     "target_tp_rank": "-1", "target_pp_rank": "-1"})).json()
        assert (info["dp_size"], info["follow_bootstrap_room"], info["page_size"]) == (2, True, 1)
        rank1 = (await c.get(base + "/route", params={"prefill_dp_rank": "1", "prefill_cp_rank": "0",
                                                      "target_tp_rank": "0", "target_pp_rank": "0"})).json()
        assert rank1 == {"rank_ip": "127.0.0.1", "rank_port": p.ctx.sglang_kv[1].port}
        missing = await c.get(base + "/route", params={"prefill_dp_rank": "5", "prefill_cp_rank": "0",
                                                       "target_tp_rank": "0", "target_pp_rank": "0"})
        assert missing.status_code == 404
        assert (await c.get(base + "/route")).status_code == 400


async def test_dp_ranks_the_prefill_follows_the_room_the_decode_names_it(emulator: MakeEmulator) -> None:
    p, d = await pair(emulator, dp=2, waiting_timeout_s=0.5, bootstrap_timeout_s=0.5)
    room = 2 * random.getrandbits(61) + 1  # odd: prefill rank 1
    body = pd_body(p, room, routed_dp_rank=0, disagg_prefill_dp_rank=1)
    leg_p, leg_d = await asyncio.gather(post(p.url, {**pd_body(p, room)}), post(d.url, body))
    assert leg_p.headers["x-emulator-data-parallel-rank"] == "1"
    assert leg_d.headers["x-emulator-data-parallel-rank"] == "0"
    assert leg_d.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # a decode that names another prefill rank than the room's never meets its prefill
    room = 2 * random.getrandbits(61) + 1
    wrong = pd_body(p, room, routed_dp_rank=1, disagg_prefill_dp_rank=0)
    leg_p, leg_d = await asyncio.gather(post(p.url, pd_body(p, room)), post(d.url, wrong))
    assert leg_p.status_code == 500
    assert "KVPoll.Bootstrapping" in leg_p.json()["message"]
    assert leg_d.status_code == 500
    assert "KVPoll.WaitingForInput" in leg_d.json()["message"]
