"""SGLang's prefill/decode legs (`srt/disaggregation/{prefill,decode}.py`), for the SGLang face.

The router sends one body to both servers at once, with `bootstrap_host` (the prefill's host),
`bootstrap_port` (its bootstrap server) and `bootstrap_room` (a random id in [0, 2^63)); a server
in `--disaggregation-mode prefill|decode` refuses a request without a room (400 "Disaggregated
request received without bootstrap room id").

* Decode: asks the prefill's bootstrap server for its layout and for the prefill rank's KV manager
  (rank `disagg_prefill_dp_rank` when the request names it, else `bootstrap_room % dp_size` when the
  prefill follows the room), pushes its readiness for the room there, and waits (its request
  *waiting*, as SGLang's transfer queue) for the KV; it gives up after
  `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` with "Request R timed out after Ts in
  KVPoll.WaitingForInput" (500) and tells the prefill (`ABORT`). Its own rank is `routed_dp_rank`.
* Prefill: its rank follows the room (`follow_bootstrap_room`); it waits in its bootstrap queue
  for the decode of the room, up to `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` ("Request R timed out
  after Ts in KVPoll.Bootstrapping", 500), then computes the prompt (one output token), sends the
  KV the decode lacks (the modelled transfer, its blocks held meanwhile) and answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from backends.emulator.context import FaceContext
from backends.emulator.sglang_kv import Registration

NO_ROOM = "Disaggregated request received without bootstrap room id"


class LegFailed(Exception):
    """A P/D leg SGLang aborts with status 500; the message is SGLang's."""


def room_of(body: dict[str, Any]) -> int | None:
    room = body.get("bootstrap_room")
    return room if isinstance(room, int) and not isinstance(room, bool) else None


def disagg_mode(ctx: FaceContext) -> str | None:
    """`prefill` or `decode`; None in SGLang's `null` mode (role both, or no P/D)."""
    pd = ctx.config.disagg
    return pd.role if pd is not None and pd.role != "both" else None


def _kv_error(room: int, reason: str) -> str:
    return f"KVTransferError(bootstrap_room={room}): {reason}"


async def await_decode(ctx: FaceContext, rank: int, room: int, rid: str) -> Registration:
    """Prefill: the decode registered for `room` on this rank (bootstrap queue)."""
    pd = ctx.config.disagg
    assert pd is not None
    start = time.monotonic()
    try:
        return await ctx.sglang_kv[rank].decode_for(room, pd.bootstrap_timeout_s)
    except TimeoutError:
        ctx.stats.pd_failed += 1
        elapsed = time.monotonic() - start
        raise LegFailed(
            f"Prefill bootstrap failed for request rank={rank} req.rid='{rid}' req.bootstrap_room={room} with "
            f"exception {_kv_error(room, f'Request {room} timed out after {elapsed:.1f}s in KVPoll.Bootstrapping')}"
        ) from None


async def send_kv(ctx: FaceContext, rank: int, reg: Registration, room: int, prompt: Sequence[int]) -> None:
    """Prefill, after its forward pass: transfer what the decode lacks, then tell it."""
    engine = ctx.ranks[rank].driver.engine
    tokens = max(0, len(prompt) - reg.prefix_len)
    blocks = engine.blocks_for(len(prompt))
    engine.hold_blocks(blocks)
    ctx.ranks[rank].driver.refresh()
    try:
        await asyncio.sleep(ctx.profile.kv_transfer_s(tokens) / ctx.config.speed)
    finally:
        engine.release_blocks(blocks)
        ctx.ranks[rank].driver.refresh()
    await ctx.sglang_kv[rank].push(reg.host, reg.port, "DONE", room, tokens)
    ctx.stats.kv_produced += 1


async def fetch_kv(ctx: FaceContext, rank: int, body: dict[str, Any], room: int, prompt: Sequence[int],
                   rid: str) -> int:
    """Decode: rendezvous with the prefill for `room` and wait for its KV; returns the prompt
    tokens whose KV this server now holds (its own prefix plus the transferred rest)."""
    pd = ctx.config.disagg
    assert pd is not None
    head = f"decode_req.req.rid='{rid}' decode_req.req.bootstrap_room={room}"
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    try:
        rank_ip, rank_port = await _prefill_rank(str(host), int(str(port)), room, body.get("disagg_prefill_dp_rank"))
    except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, KeyError) as exc:
        ctx.stats.pd_failed += 1
        reason = f"Could not fetch prefill parallel info from {host}:{port}: {exc}"
        raise LegFailed(f"Decode handshake failed for request rank={rank} {head} with exception "
                        f"{_kv_error(room, reason)}") from None
    manager = ctx.sglang_kv[rank]
    driver = ctx.ranks[rank].driver
    prefix = driver.engine.cache.match(prompt[:-1])
    status = manager.expect_kv(room)
    driver.engine.deferred += 1
    driver.refresh()
    start = time.monotonic()
    try:
        await manager.push(rank_ip, rank_port, "ROOM", room, manager.host, manager.port, prefix)
        result = await asyncio.wait_for(status, pd.waiting_timeout_s)
    except TimeoutError:
        ctx.stats.pd_failed += 1
        await manager.push(rank_ip, rank_port, "ABORT", room, manager.host, manager.port)
        elapsed = time.monotonic() - start
        reason = f"Request {room} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput"
        raise LegFailed(f"Decode transfer failed for request rank={rank} {head} with exception "
                        f"{_kv_error(room, reason)}") from None
    finally:
        manager.forget(room)
        driver.engine.deferred -= 1
        driver.refresh()
    if isinstance(result, str):
        ctx.stats.pd_failed += 1
        raise LegFailed(f"Decode transfer failed for request rank={rank} {head} with exception "
                        f"{_kv_error(room, result)}")
    ctx.stats.kv_pulled += 1
    ctx.stats.kv_pulled_tokens += result
    return len(prompt)


async def _prefill_rank(host: str, port: int, room: int, named: object) -> tuple[str, int]:
    """The KV manager of the prefill rank serving `room`, from the prefill's bootstrap server."""
    base = f"http://{host}:{port}"
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{base}/route", params=_ranks(-1, -1, -1, -1)) as r:
            if r.status != 200:
                raise ValueError(f"{r.status} {await r.text()}")
            info = await r.json()
        if isinstance(named, int) and not isinstance(named, bool):
            dp_rank = named
        elif info["follow_bootstrap_room"]:
            dp_rank = room % int(info["dp_size"])
        else:
            async with session.post(f"{base}/query_dp_ranks", json={"bootstrap_rooms": [room]}) as r:
                dp_rank = int((await r.json())[str(room)])
        async with session.get(f"{base}/route", params=_ranks(dp_rank, 0, 0, 0)) as r:
            if r.status != 200:
                raise ValueError(f"{r.status} {await r.text()}")
            rank = await r.json()
    return str(rank["rank_ip"]), int(rank["rank_port"])


def _ranks(dp: int, cp: int, tp: int, pp: int) -> dict[str, str]:
    return {"prefill_dp_rank": str(dp), "prefill_cp_rank": str(cp), "target_tp_rank": str(tp),
            "target_pp_rank": str(pp)}
