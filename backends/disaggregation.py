"""The bodies of a disaggregated request's legs, per runtime: pure transforms of the client's body.

vLLM (its P/D connectors: NixlConnector, P2pNcclConnector, Mooncake, LMCache, ExampleConnector),
as vLLM's own proxies and routers do it (`toy_proxy_server.py`, vllm-router's `pd_router`), two
legs in sequence:

* leg 1, to a prefill server: the client's body with `kv_transfer_params: {"do_remote_decode": true,
  "do_remote_prefill": false}`, one output token (`max_tokens`, and `max_completion_tokens` /
  `max_output_tokens` where the client gave them), `stream: false`, no `stream_options`, no
  `min_tokens`, `n: 1`. Its answer carries a top-level `kv_transfer_params` (NixlConnector:
  `do_remote_prefill`, `remote_engine_id`, `remote_block_ids`, `remote_request_id`, `remote_host`,
  `remote_port`, `tp_size`; other connectors their own keys): `vllm_handoff` reads it;
* leg 2, to a decode server: the client's own body with those params verbatim (`vllm_decode_body`).

vLLM always writes the key, `null` when the connector returned nothing: a shared-storage connector
(ExampleConnector) says null and its decode finds the KV by prompt, while for NixlConnector a null
means the decode will recompute the prefill. Which one is expected is the route's `handoff`.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import orjson

PREFILL_ONLY: Final = {"do_remote_decode": True, "do_remote_prefill": False}
_ONE_TOKEN: Final = ("max_completion_tokens", "max_output_tokens")
_DROPPED: Final = ("stream_options", "min_tokens")

Handoff = Literal["ok", "null", "missing", "invalid"]


def vllm_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """Leg 1's body: prefill only, one token, one choice, not streamed."""
    out = {k: v for k, v in body.items() if k not in _DROPPED}
    out["kv_transfer_params"] = dict(PREFILL_ONLY)
    out["max_tokens"] = 1
    for name in _ONE_TOKEN:
        if name in out:
            out[name] = 1
    out["stream"] = False
    out["n"] = 1
    return out


def vllm_handoff(answer: bytes) -> tuple[Handoff, dict[str, Any] | None]:
    """What leg 1's answer hands the decode: ("ok", params) when it carries an object of
    `kv_transfer_params`; "null" when vLLM said null (no params from the connector), "missing" when
    the key is absent (not a vLLM answer, or one without a KV connector), "invalid" otherwise."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return "invalid", None
    if not isinstance(parsed, dict):
        return "invalid", None
    if "kv_transfer_params" not in parsed:
        return "missing", None
    params = parsed["kv_transfer_params"]
    if params is None:
        return "null", None
    if not isinstance(params, dict) or not params:
        return "invalid", None
    return "ok", params


def vllm_decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """Leg 2's body: the client's, with the prefill's params verbatim (none: the client's as it is,
    a client's own `kv_transfer_params` removed, so that a decode is never told of a prefill the
    gateway did not run)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params is not None:
        out["kv_transfer_params"] = params
    return out


# SGLang (`--disaggregation-mode prefill|decode`, sgl-model-gateway's PD router): one body to both
# legs at once, naming the prefill's bootstrap server and a room (the rendezvous key); the prefill
# sends its KV to the decode that joins the same room. With data parallelism the prefill's rank
# follows the room (`room % dp_size`, SGLang's `follow_bootstrap_room`) and the decode is told it
# (`disagg_prefill_dp_rank`).
ROOM_BITS: Final = 63


def sglang_room(bits: int, rank: int | None, size: int) -> int:
    """A room in [0, 2^63) from `bits` (random, 63 of them) with `room % size == rank`."""
    if rank is None or size <= 1:
        return bits
    room = bits - bits % size + rank
    return room if room < 1 << ROOM_BITS else room - size


def sglang_bodies(body: dict[str, Any], *, host: str, port: int, room: int,
                  prefill_rank: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefill's and the decode's bodies: the client's with the rendezvous; the prefill's is
    not streamed (its answer is drained), the decode's names the prefill's rank when it has one."""
    shared = {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    prefill = {k: v for k, v in shared.items() if k != "stream_options"}
    prefill["stream"] = False
    decode = dict(shared)
    if prefill_rank is not None:
        decode["disagg_prefill_dp_rank"] = prefill_rank
    return prefill, decode


# trtllm-serve (its `trtllm-serve disaggregated` orchestrator): leg 1 to a context server with
# `disaggregated_params: {request_type: context_only}`, not streamed; its `choices[0].
# disaggregated_params` (`ctx_request_id`, `encoded_opaque_state`, `first_gen_tokens`, ...) go to
# a generation server with `request_type: generation_only`. A context answer that already finished
# (its finish reason is neither `length` nor `not_finished`) is the whole answer.
def trtllm_context_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in ("stream_options", "disaggregated_params")}
    out["disaggregated_params"] = {"request_type": "context_only"}
    out["stream"] = False
    return out


def trtllm_handoff(answer: bytes) -> tuple[Handoff, dict[str, Any] | None, bool]:
    """(state, the params, whether the context answer is already the whole answer)."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return "invalid", None, False
    choices = parsed.get("choices") if isinstance(parsed, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "invalid", None, False
    choice = choices[0]
    finished = choice.get("finish_reason") not in (None, "length", "not_finished")
    if "disaggregated_params" not in choice:
        return "missing", None, finished
    params = choice["disaggregated_params"]
    if params is None:
        return "null", None, finished
    if not isinstance(params, dict) or not params:
        return "invalid", None, finished
    return "ok", params, finished


def trtllm_generation_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k != "disaggregated_params"}
    if params is not None:
        out["disaggregated_params"] = {**params, "request_type": "generation_only"}
    return out
