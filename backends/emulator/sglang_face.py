"""The SGLang 0.5.23 face (spec section 3), as if started with `--enable-metrics --enable-cache-report`:
32-hex ids without prefix, `reasoning_content: null` in deltas, finish_reason in its own empty-delta
chunk, flat error bodies, the model name echoed (never validated), a `/health` that pushes a 1-token
generation through the engine, `/v1/loads`, and the native `/generate` (in `sglang_native`)."""

from __future__ import annotations

import functools
import time
from typing import Any

from aiohttp import web

from backends.emulator import sglang_aux, sglang_pd
from backends.emulator.context import CONTEXT_KEY, FaceContext, Generation
from backends.emulator.dp import BadRank, mark_served, served_rank_header, sglang_rank
from backends.emulator.openai_common import (
    DONE,
    BodyError,
    ChatRequest,
    Died,
    FieldError,
    build_request,
    event,
    flat_error,
    json_response,
    open_sse,
    parse_body,
    python_runtime_app,
    stream_tokens,
)
from backends.emulator.sglang_common import METRICS_KEY, NOT_GENERATION, Reject, admit, matched
from backends.emulator.sglang_metrics import SglangMetrics
from backends.emulator.sglang_native import (
    flush_cache,
    health,
    loads,
    metrics_endpoint,
    model_card,
    model_info,
    models,
    native_generate,
    ready,
    server_info,
)
from backends.emulator.structured import ShapeError, ToolCallLayout, ToolCallStream, json_array_layout
from backends.emulator.textgen import OutputPlan


def _validate(ctx: FaceContext, raw: bytes, *, chat: bool) -> ChatRequest:
    try:
        body = parse_body(raw)
    except BodyError as exc:
        raise Reject(400, f"JSON decode error: {exc}", "Bad Request") from None
    field = "messages" if chat else "prompt"
    if field not in body:
        raise Reject(400, f"1 validation error:\n  Field required: body.{field}", "Bad Request")
    try:
        req = build_request(body, chat=chat, default_max_tokens=None)
    except FieldError as exc:
        raise Reject(400, f"1 validation error:\n  {exc.msg}: body.{exc.field}", "Bad Request") from None
    except ShapeError as exc:
        raise Reject(400, str(exc), "BadRequest") from None
    limit, p = ctx.config.max_model_len, len(req.prompt)
    if p >= limit:
        raise Reject(400, f"The input ({p} tokens) is longer than the model's context length ({limit} tokens).",
                      "BadRequest")
    if req.max_tokens is not None and p + req.max_tokens > limit:
        raise Reject(400, (
            f"Requested token count exceeds the model's maximum context length of {limit} tokens. You requested a "
            f"total of {p + req.max_tokens} tokens: {p} tokens from the input messages and {req.max_tokens} tokens "
            "for the completion. Please reduce the number of tokens in the input messages or the completion to fit "
            "within the limit."), "BadRequest")
    return req


async def _refused(request: web.Request, req: ChatRequest, rej: Reject) -> web.StreamResponse:
    if not req.stream:
        return json_response(rej.body(), rej.status)
    resp = await open_sse(request)
    await resp.write(event({"error": rej.body()}))
    await resp.write(DONE)
    return resp


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}, "reasoning_tokens": 0,
            "completion_tokens_details": None}


async def generate(request: web.Request) -> web.StreamResponse:
    ctx, metrics = request.app[CONTEXT_KEY], request.app[METRICS_KEY]
    chat = request.path.endswith("/chat/completions")
    ctx.stats.requests_received += 1
    try:
        req = _validate(ctx, await request.read(), chat=chat)
    except Reject as rej:
        return json_response(rej.body(), rej.status)
    if ctx.config.embedding_dim is not None:
        return json_response(Reject(400, NOT_GENERATION, "BadRequest").body(), 400)
    try:
        admit(ctx)
    except Reject as rej:
        if rej.err_type == "SERVICE_UNAVAILABLE" and req.stream:
            # The scheduler aborts the request after the stream has started: an error chunk, not a 503.
            resp = await open_sse(request)
            await resp.write(event({"error": rej.body()}))
            await resp.write(DONE)
            return resp
        return json_response(rej.body(), rej.status)
    model = str(req.body.get("model") or "default")
    room = ctx.config.max_model_len - len(req.prompt)
    max_tokens = req.max_tokens if req.max_tokens is not None or ctx.profile.default_output_tokens <= room else room
    tool = req.shape.tool
    layout = json_array_layout(tool.name, req.shape.json_text()) if tool is not None else None
    text = layout.text if layout is not None else req.shape.json_text() if req.shape.kind == "json" else None
    plans = ctx.plans(req.n, max_tokens=max_tokens, stop=req.stop, text=text)
    try:
        rank = sglang_rank(req.body, ctx.data_parallel_size)
    except BadRank as bad_rank:  # the tokenizer manager's ValueError: a 400, or an error chunk in a stream
        return await _refused(request, req, Reject(400, str(bad_rank), "BadRequest"))
    boot_room = sglang_pd.room_of(req.body)  # a P/D request: SGLang's prefill rank follows its room
    mode = sglang_pd.disagg_mode(ctx)
    if mode is not None and boot_room is None:
        return await _refused(request, req, Reject(400, sglang_pd.NO_ROOM, "BadRequest"))
    rid = ctx.hex_id(32)
    chosen = ctx.choose_rank(rank, room=None if mode == "decode" else boot_room)
    external, reg = 0, None
    try:
        if mode == "prefill" and boot_room is not None:  # bootstrap queue: wait for the room's decode
            reg = await sglang_pd.await_decode(ctx, chosen, boot_room, rid)
            plans = ctx.plans(req.n, max_tokens=1)  # a prefill server computes the prompt and one token
        elif mode == "decode" and boot_room is not None:  # prealloc + transfer queues: wait for the KV
            external = await sglang_pd.fetch_kv(ctx, chosen, req.body, boot_room, req.prompt, rid)
    except sglang_pd.LegFailed as exc:
        return await _refused(request, req, Reject(500, str(exc), "InternalServerError"))
    gen = ctx.start(req.prompt, plans, chosen=chosen, external_tokens=external)
    if reg is not None and boot_room is not None:
        gen.before_finish = functools.partial(sglang_pd.send_kv, ctx, chosen, reg, boot_room, req.prompt)
    mark_served(request, gen.rank, ctx.data_parallel_size)
    metrics.register(gen.rids, streaming=req.stream)
    try:
        if req.stream:
            return await _stream(ctx, request, req, gen, rid, model, layout)
        texts: list[list[str]] = [[] for _ in plans]
        try:
            async for tok in stream_tokens(ctx, request, gen):
                texts[tok.choice].append(tok.piece)
        except Died:
            return web.Response(status=500)
        choices: list[dict[str, Any]] = []
        for i, plan in enumerate(plans):
            out = "".join(texts[i])
            if chat and layout is not None and layout.complete(len(out)):
                # SGLang parses the call out of the text: content null, finish "tool_calls", no matched stop.
                call = {"id": f"call_{ctx.hex_id(24)}", "index": 0, "type": "function",
                        "function": {"name": layout.name, "arguments": layout.arguments}}
                choices.append({"index": i, "message": {"role": "assistant", "content": None,
                                                        "reasoning_content": None, "tool_calls": [call]},
                                "logprobs": None, "finish_reason": "tool_calls", "matched_stop": None})
            elif chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": out,
                                                        "reasoning_content": None},
                                "logprobs": None, "finish_reason": plan.finish_reason, "matched_stop": matched(plan)})
            else:
                choices.append({"index": i, "text": out, "logprobs": None, "finish_reason": plan.finish_reason,
                                "matched_stop": matched(plan)})
        completion = sum(len(t) for t in texts)
        return json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(len(req.prompt), completion, gen.cached_tokens),
            "metadata": {"weight_version": "default"},
        })
    finally:
        gen.abort()


def _tool_chunk(head: dict[str, Any], index: int, call: dict[str, Any]) -> dict[str, Any]:
    """A tool-call delta as SGLang writes it (pydantic `model_dump_json`: every null kept)."""
    delta = {"role": None, "content": None, "reasoning_content": None, "tool_calls": [call]}
    return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None,
                                 "matched_stop": None}], "usage": None}


async def _stream(
    ctx: FaceContext, request: web.Request, req: ChatRequest, gen: Generation, rid: str, model: str,
    layout: ToolCallLayout | None,
) -> web.StreamResponse:
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    head = {"id": rid, "object": obj, "created": int(time.time()), "model": model}
    counts = [0] * req.n
    prompt = len(req.prompt)
    trackers: dict[int, ToolCallStream] = {}

    def choice(i: int, content: str | None, *, role: bool = False, plan: OutputPlan | None = None) -> dict[str, Any]:
        c: dict[str, Any] = {"index": i}
        if req.chat:
            delta: dict[str, Any] = {"reasoning_content": None}
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            c["delta"] = delta
        else:
            c["text"] = content or ""
        c["logprobs"] = None
        c["finish_reason"] = plan.finish_reason if plan else None
        c["matched_stop"] = matched(plan) if plan else None
        return c

    def mid_stream_error() -> bytes:
        return event({"error": flat_error(500, "Internal server error", "InternalServerError")})

    resp = await open_sse(request)
    try:
        started = False
        async for tok in stream_tokens(ctx, request, gen, on_error_event=mid_stream_error, resp=resp):
            if not started and req.chat:
                for i in range(req.n):
                    await resp.write(event({**head, "choices": [choice(i, "", role=True)]}))
            started = True
            counts[tok.choice] += 1
            if layout is not None and req.chat:
                tracker = trackers.setdefault(tok.choice, ToolCallStream(layout))
                name_now, fragment = tracker.feed(tok.piece)
                if name_now:
                    first = {"id": f"call_{ctx.hex_id(24)}", "index": 0, "type": "function",
                             "function": {"name": layout.name, "arguments": ""}}
                    await resp.write(event(_tool_chunk(head, tok.choice, first)))
                if fragment:
                    args = {"name": None, "arguments": fragment}
                    more = {"id": None, "index": 0, "type": "function", "function": args}
                    await resp.write(event(_tool_chunk(head, tok.choice, more)))
                if tok.finished is not None:
                    plan = gen.plans[tok.choice]
                    end = choice(tok.choice, None, plan=plan)
                    if tracker.complete:
                        end["finish_reason"], end["matched_stop"] = "tool_calls", None
                    await resp.write(event({**head, "choices": [end]}))
                continue
            chunk: dict[str, Any] = {**head, "choices": [choice(tok.choice, tok.piece)]}
            if req.continuous_usage:
                chunk["usage"] = _usage(prompt, counts[tok.choice], gen.cached_tokens)
            await resp.write(event(chunk))
            if tok.finished is not None:
                plan = gen.plans[tok.choice]
                await resp.write(event({**head, "choices": [choice(tok.choice, None if req.chat else "", plan=plan)]}))
        if req.include_usage:
            await resp.write(event({**head, "choices": [], "usage": _usage(prompt, sum(counts), gen.cached_tokens)}))
        await resp.write(DONE)
        await resp.write_eof()
    except (Died, ConnectionResetError):
        pass
    return resp


def build_app(ctx: FaceContext, metrics: SglangMetrics) -> web.Application:
    app = python_runtime_app()
    app[CONTEXT_KEY] = ctx
    app[METRICS_KEY] = metrics
    app.on_response_prepare.append(served_rank_header)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/generate", native_generate)
    app.router.add_put("/generate", native_generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model_card)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/ping", ready)
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/flush_cache", flush_cache)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/metrics", metrics_endpoint)
    sglang_aux.add_routes(app)
    return app
