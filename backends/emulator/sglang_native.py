"""SGLang's native and control endpoints: `/generate`, health and readiness, model and server info,
`/v1/loads`, `/flush_cache` and `/metrics`."""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any

from aiohttp import web

from backends.emulator import tokenizer
from backends.emulator.context import CONTEXT_KEY, FaceContext
from backends.emulator.exposition import render
from backends.emulator.openai_common import (
    DONE,
    BodyError,
    Died,
    event,
    json_response,
    open_sse,
    parse_body,
    stop_list,
    stream_tokens,
)
from backends.emulator.sglang_common import EOS_ID, HEALTH_TIMEOUT_S, METRICS_KEY, VERSION, Reject, admit
from backends.emulator.sglang_metrics import SglangMetrics


async def native_generate(request: web.Request) -> web.StreamResponse:
    """SGLang's `/generate`: cumulative text per streamed event, meta_info with cached_tokens."""
    ctx = request.app[CONTEXT_KEY]
    ctx.stats.requests_received += 1
    try:
        body = parse_body(await request.read())
        admit(ctx)
    except BodyError as exc:
        return json_response({"error": {"message": str(exc)}}, 400)
    except Reject as rej:
        return json_response({"error": {"message": rej.message}}, rej.status)
    try:
        if "input_ids" in body and body["input_ids"] is not None:
            prompt = [int(t) for t in body["input_ids"]]
        else:
            prompt = tokenizer.encode(str(body.get("text", "")))
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        stop = stop_list(sp.get("stop"))
    except (TypeError, ValueError, AttributeError) as exc:
        return json_response({"error": {"message": f"Invalid request: {exc}"}}, 400)
    plan = ctx.plans(1, max_tokens=max_new, stop=stop)
    gen = ctx.start(prompt, plan)
    rid = str(body.get("rid") or ctx.hex_id(32))
    text: list[str] = []
    ids: list[int] = []

    def payload(fin: bool, e2e: float | None) -> dict[str, Any]:
        p = plan[0]
        reason: dict[str, Any] | None = None
        if fin:
            reason = {"type": "length", "length": len(ids)} if p.finish_reason == "length" else {
                "type": "stop", "matched": p.stop_reason if p.stop_reason is not None else EOS_ID}
        meta: dict[str, Any] = {"id": rid, "finish_reason": reason, "prompt_tokens": len(prompt),
                                "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
                                "completion_tokens": len(ids), "cached_tokens": gen.cached_tokens}
        if e2e is not None:
            meta["e2e_latency"] = e2e
        return {"text": "".join(text), "output_ids": list(ids), "meta_info": meta}

    try:
        resp: web.StreamResponse | None = await open_sse(request) if body.get("stream") else None
        try:
            async for tok in stream_tokens(ctx, request, gen):
                text.append(tok.piece)
                ids.append(tok.token_id)
                fin = tok.finished
                if resp is not None:
                    await resp.write(event(payload(fin is not None, fin.e2e_s if fin else None)))
                elif fin is not None:
                    return json_response(payload(True, fin.e2e_s))
        except (Died, ConnectionResetError):
            return resp if resp is not None else web.Response(status=500)
        if resp is None:
            return json_response(payload(True, 0.0))
        await resp.write(DONE)
        await resp.write_eof()
        return resp
    finally:
        gen.abort()


async def health(request: web.Request) -> web.Response:
    """503 while starting; otherwise 200 once a 1-token generation comes out of the engine."""
    ctx = request.app[CONTEXT_KEY]
    if not ctx.gate.ready():
        return web.Response(status=503)
    gen = ctx.start([0], ctx.plans(1, max_tokens=1), health=True)
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            async for _ in gen.tokens():
                return web.Response(status=200)
    except TimeoutError:
        pass
    finally:
        gen.abort()
    return web.Response(status=503)


async def ready(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[CONTEXT_KEY].gate.ready() else 503)


def _card(ctx: FaceContext) -> dict[str, Any]:
    return {"id": ctx.model, "object": "model", "created": ctx.created, "owned_by": "sglang", "root": ctx.model,
            "parent": None, "max_model_len": ctx.config.max_model_len}


async def models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_card(request.app[CONTEXT_KEY])]})


async def model_card(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    name = request.match_info["model"]
    if name != ctx.model:
        return json_response({"error": {"message": f"The model '{name}' does not exist",
                                        "type": "invalid_request_error", "param": "model",
                                        "code": "model_not_found"}}, 404)
    return json_response(_card(ctx))


async def model_info(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    return json_response({
        "model_path": ctx.model, "served_model_name": ctx.model, "tokenizer_path": ctx.model,
        "is_generation": ctx.config.embedding_dim is None,
        "preferred_sampling_params": None, "weight_version": "default", "load_format": "auto",
        "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": request.app[METRICS_KEY].mode,
        "has_image_understanding": False, "has_audio_understanding": False, "model_type": "emulated",
        "architectures": ["EmulatedForCausalLM"]})


def _load(ctx: FaceContext, metrics: SglangMetrics) -> dict[str, Any]:
    snap = ctx.snapshot()
    total = ctx.params.kv_blocks * ctx.params.block_size
    used = snap.kv_used_blocks * snap.block_size
    return {
        "timestamp": time.time(), "dp_rank": 0, "num_running_reqs": snap.running,
        "num_waiting_reqs": snap.waiting - snap.deferred,
        "num_waiting_uncached_tokens": snap.waiting_uncached_tokens, "num_used_tokens": used,
        "num_total_tokens": used, "max_total_num_tokens": total, "max_running_requests": ctx.params.max_num_seqs,
        "token_usage": snap.kv_usage, "gen_throughput": metrics.published["gen_throughput"],
        "cache_hit_rate": metrics.published["cache_hit_rate"], "utilization": 0.0,
    }


async def loads(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    now = datetime.datetime.now(datetime.UTC).isoformat()
    return json_response({"timestamp": now, "version": VERSION, "accelerator": ctx.profile.hardware,
                          "num_accelerators": ctx.profile.gpus, "loads": [_load(ctx, request.app[METRICS_KEY])]})


async def server_info(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    return json_response({
        "model_path": ctx.model, "served_model_name": ctx.model, "context_length": ctx.config.max_model_len,
        "page_size": ctx.params.block_size, "max_running_requests": ctx.params.max_num_seqs,
        "chunked_prefill_size": ctx.params.max_batched_tokens, "enable_metrics": True, "enable_cache_report": True,
        "internal_states": [{"last_gen_throughput": request.app[METRICS_KEY].published["gen_throughput"]}],
        "version": VERSION, "frontend": "python"})


async def flush_cache(request: web.Request) -> web.Response:
    """Flush the radix cache (refused, like SGLang, while requests are running or waiting)."""
    ctx = request.app[CONTEXT_KEY]
    if not all(r.driver.engine.idle for r in ctx.ranks):
        return web.Response(status=400, text="Cache not flushed. Please check backend logs for more details. "
                                              "(When there are running or waiting requests, the operation will not "
                                              "be performed.)\n")
    for r in ctx.ranks:
        r.driver.engine.cache.clear()
        ctx.flush_kv_events(r.rank)
    return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                             "or waiting requests, the operation will not be performed.)\n")


async def metrics_endpoint(request: web.Request) -> web.Response:
    return render(request.app[METRICS_KEY].registry, request)
