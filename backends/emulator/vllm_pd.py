"""vLLM's prefill/decode legs (KV connectors), for the vLLM face.

* NixlConnector, prefill (`kv_role` kv_producer or kv_both): a request whose `kv_transfer_params`
  say `do_remote_decode: true` runs as usual (the proxy sends `max_tokens: 1`); when it finishes
  *capped by length* (`FINISHED_LENGTH_CAPPED`; a request that stops on EOS frees its blocks and
  returns no params) its blocks are kept (`kv_handoff`) and the non-streaming answer carries
  `kv_transfer_params: {do_remote_prefill: true, do_remote_decode: false, remote_block_ids,
  remote_engine_id, remote_request_id, remote_host, remote_port, tp_size}` (`request_finished`).
* NixlConnector, decode (kv_consumer or kv_both): `do_remote_prefill: true` with non-empty
  `remote_block_ids` and every `remote_*` key pulls the blocks from the prefill's side channel,
  waits for the transfer (the request is *waiting*, reason `deferred`, as vLLM's
  WAITING_FOR_REMOTE_KVS) and skips the prefill of the loaded tokens, counted under
  `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`. Invalid params ("Got
  invalid KVTransferParams ... will not utilize KVTransfer") or a failed load
  (`kv_load_failure_policy: recompute`, the default) recompute the prefill silently, counted as
  `local_compute`; with `kv_load_failure_policy: fail` a failed load fails the request.
* ExampleConnector (`shared_storage`): no params; every request looks its prompt up in the shared
  directory and loads what is there, and writes what was not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.emulator.context import FaceContext
from backends.emulator.kv_handoff import PullError, common_prefix, pull

log = logging.getLogger(__name__)
NIXL = "NixlConnector"
EXAMPLE_CONNECTORS = frozenset({"ExampleConnector", "SharedStorageConnector"})
CONNECTORS = frozenset({NIXL, *EXAMPLE_CONNECTORS})
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass(frozen=True, slots=True)
class Remote:
    """Where a decode pulls its prompt's KV from (the prefill's params, validated)."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int


class LoadFailed(Exception):
    """A KV load failed under `kv_load_failure_policy: fail`: the request fails."""


def wants_remote_decode(ctx: FaceContext, params: object) -> bool:
    """A prefill-only request this server produces KV for (NixlConnector, producer role)."""
    pd = ctx.config.disagg
    return (pd is not None and pd.produces and pd.connector == NIXL and isinstance(params, dict)
            and bool(params.get("do_remote_decode")))


def remote_of(params: dict[str, Any]) -> Remote | None:
    """The params' remote prefill, or None when they are not valid NixlConnector params."""
    blocks = params.get("remote_block_ids")
    if not blocks or not isinstance(blocks, list) or not all(k in params for k in REMOTE_KEYS):
        return None
    try:
        return Remote(str(params["remote_engine_id"]), str(params["remote_request_id"]),
                      tuple(int(b) for b in blocks), str(params["remote_host"]), int(params["remote_port"]))
    except (TypeError, ValueError):
        return None


async def load_external(ctx: FaceContext, rank: int, prompt: Sequence[int], params: object) -> int:
    """Prompt tokens whose KV this request loads from elsewhere (0: computed here), after paying
    the modelled transfer; raises LoadFailed under the `fail` policy."""
    pd = ctx.config.disagg
    if pd is None or not pd.consumes:
        return 0
    if pd.connector in EXAMPLE_CONNECTORS:
        found = ctx.shared_storage.lookup(prompt) if ctx.shared_storage is not None else 0
        loaded = min(found, len(prompt) - 1)
        if loaded > 0:
            await transfer(ctx, rank, loaded)
        return loaded
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return 0
    remote = remote_of(params)
    if remote is None:
        log.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params)
        ctx.stats.kv_recomputed += 1
        return 0
    try:
        tokens = await pull(ctx.zmq_context(), host=remote.host, port=remote.port, engine_id=remote.engine_id,
                            request_id=remote.request_id, block_ids=remote.block_ids)
    except PullError as exc:
        if pd.load_failure_policy == "fail":
            ctx.stats.pd_failed += 1
            raise LoadFailed(str(exc)) from None
        log.warning("KV load from %s:%s failed (%s); recomputing the prefill", remote.host, remote.port, exc)
        ctx.stats.kv_recomputed += 1
        return 0
    loaded = min(common_prefix(tokens, prompt, ctx.params.block_size), len(prompt) - 1)
    if loaded <= 0:
        ctx.stats.kv_recomputed += 1
        return 0
    await transfer(ctx, rank, loaded)
    return loaded


async def transfer(ctx: FaceContext, rank: int, tokens: int) -> None:
    """Wait the modelled transfer time of `tokens` tokens of KV (simulated seconds / speed); the
    request counts as waiting (deferred) on `rank`'s engine meanwhile."""
    driver = ctx.ranks[rank].driver
    driver.engine.deferred += 1
    driver.refresh()
    try:
        await asyncio.sleep(ctx.profile.kv_transfer_s(tokens) / ctx.config.speed)
    finally:
        driver.engine.deferred -= 1
        driver.refresh()
    ctx.stats.kv_pulled += 1
    ctx.stats.kv_pulled_tokens += tokens


def produced_params(ctx: FaceContext, rank: int, engine_request_id: str, prompt: Sequence[int]) -> dict[str, Any]:
    """Keep a finished prefill's KV for its decode; the params its answer carries."""
    handoff = ctx.handoffs[rank]
    blocks = handoff.keep(engine_request_id, prompt)
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": blocks,
        "remote_engine_id": handoff.engine_id, "remote_request_id": engine_request_id,
        "remote_host": handoff.host, "remote_port": handoff.port, "tp_size": 1,
    }


def store_shared(ctx: FaceContext, prompt: Sequence[int]) -> None:
    """ExampleConnector: write the prompt's KV to the shared directory after its prefill."""
    pd = ctx.config.disagg
    if pd is not None and pd.produces and ctx.shared_storage is not None:
        ctx.shared_storage.store(prompt)
