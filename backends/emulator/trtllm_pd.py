"""trtllm-serve's context and generation legs (`disaggregated_params`), for the trtllm-serve face.

As `openai_disagg_server.py` / `openai_disagg_service.py` drive them: the context request is the
client's with `disaggregated_params: {request_type: "context_only"}`, `stream: false` and no
`stream_options`; the context server computes the prompt and the first token and answers with
`choices[0].disaggregated_params` (`request_type`, `first_gen_tokens`, `ctx_request_id`,
`encoded_opaque_state`, `draft_tokens`, ...; `DisaggregatedParams` in `openai_protocol.py`) and the
top-level `prompt_token_ids`, with `finish_reason` "not_finished" while tokens remain. A context
answer that finished otherwise ("stop", or "length" at `max_tokens: 1`... the disaggregated server
returns it as is unless the reason is "length" or "not_finished") needs no generation leg. The
generation request carries those params with `request_type: "generation_only"` (and the prompt
as `prompt_token_ids`); the generation server loads the context's KV (the cache transceiver; here
the side channel `encoded_opaque_state` points to) and decodes without the prefill.

Estimated (not read in the sources): the emulator's opaque state is base64 JSON naming the context
server's side channel; a generation request whose KV cannot be loaded fails with a 500.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

from backends.emulator.context import FaceContext
from backends.emulator.kv_handoff import PullError, common_prefix, pull
from backends.emulator.textgen import OutputPlan
from backends.emulator.vllm_pd import transfer

CONTEXT_ONLY = "context_only"
GENERATION_ONLY = "generation_only"


class LegFailed(Exception):
    """The generation leg could not load its context's KV."""


def request_type(body: dict[str, Any]) -> str | None:
    params = body.get("disaggregated_params")
    if isinstance(params, dict) and params.get("request_type") in (CONTEXT_ONLY, GENERATION_ONLY):
        return str(params["request_type"])
    return None


def context_plan(plan: OutputPlan) -> tuple[OutputPlan, str]:
    """The context leg's output (the first token) and its finish reason: the plan's own when it
    ends there, else "not_finished"."""
    finish = plan.finish_reason if len(plan.token_ids) <= 1 else "not_finished"
    first = OutputPlan(plan.pieces[:1], plan.token_ids[:1], finish, plan.stop_reason if finish == "stop" else None)
    return first, finish


def context_params(ctx: FaceContext, prompt: Sequence[int], first_token: int, finish: str,
                   disagg_request_id: object) -> dict[str, Any]:
    """Keep the context's KV for its generation leg (unless finished) and describe where it is."""
    ctx_request_id = ctx.next_int()
    handoff = ctx.handoffs[0]
    if finish in ("length", "not_finished"):
        handoff.keep(str(ctx_request_id), prompt)
    state = {"host": handoff.host, "port": handoff.port, "engine_id": handoff.engine_id}
    return {
        "request_type": CONTEXT_ONLY, "first_gen_tokens": [first_token], "ctx_request_id": ctx_request_id,
        "encoded_opaque_state": base64.b64encode(json.dumps(state).encode()).decode(), "draft_tokens": None,
        "disagg_request_id": disagg_request_id, "ctx_dp_rank": None, "ctx_info_endpoint": None,
    }


async def load_context(ctx: FaceContext, body: dict[str, Any], prompt: Sequence[int]) -> int:
    """A generation leg: pull its context's KV; the prompt tokens loaded (raises LegFailed)."""
    params = body["disaggregated_params"]
    try:
        state = json.loads(base64.b64decode(str(params["encoded_opaque_state"])))
        ctx_request_id = str(int(params["ctx_request_id"]))
        tokens = await pull(ctx.zmq_context(), host=str(state["host"]), port=int(state["port"]),
                            engine_id=str(state["engine_id"]), request_id=ctx_request_id, block_ids=None)
    except (PullError, KeyError, TypeError, ValueError) as exc:
        ctx.stats.pd_failed += 1
        raise LegFailed(f"KV cache transfer failed for ctx_request_id {params.get('ctx_request_id')}: {exc}") from None
    loaded = min(common_prefix(tokens, prompt, ctx.params.block_size), len(prompt) - 1)
    if loaded > 0:
        await transfer(ctx, 0, loaded)
    return loaded
