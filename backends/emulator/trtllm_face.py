"""The trtllm-serve face (spec 4.1): strict request schema (unknown fields are a 400 with a pydantic
string), `chatcmpl-<int>` ids in streams, the first chunk framed `data: {...} \\n\\n` (with a space),
`include_usage` defaulting to true once `stream_options` is present, cached tokens always in usage,
JSON iteration stats on `GET /metrics` and Prometheus on `/prometheus/metrics`."""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from backends.emulator import trtllm_aux, trtllm_pd
from backends.emulator.context import CONTEXT_KEY, FaceContext, Generation
from backends.emulator.exposition import render
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
from backends.emulator.structured import ShapeError, ToolCallLayout, ToolCallStream, hermes_layout
from backends.emulator.trtllm_common import METRICS_KEY, VERSION, Reject, admit, flat, pydantic
from backends.emulator.trtllm_metrics import TrtllmMetrics

_COMMON = {
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "user", "top_k", "top_p_min", "min_p", "repetition_penalty",
    "length_penalty", "early_stopping", "use_beam_search", "best_of", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "lora_request", "echo", "add_special_tokens", "disaggregated_params", "cache_salt", "prompt_token_ids",
}
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "reasoning_effort", "add_generation_prompt", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "thinking_token_budget",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "suffix"}


def _validate(ctx: FaceContext, raw: bytes, *, chat: bool) -> ChatRequest:
    model_name = "ChatCompletionRequest" if chat else "CompletionRequest"
    try:
        body = parse_body(raw)
    except BodyError as exc:
        raise Reject(400, {"error": f"JSON decode error: {exc}"}) from None
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key in body:
        if key not in allowed:
            raise pydantic(model_name, key, "Extra inputs are not permitted", "extra_forbidden", body[key])
    required = "messages" if chat else "prompt"
    if required not in body:
        raise pydantic(model_name, required, "Field required", "missing", body)
    if body.get("stream_options") is not None and not body.get("stream"):
        raise pydantic(model_name, "", "Value error, stream_options can only be set if stream is true",
                        "value_error", body)
    try:
        req = build_request(body, chat=chat, default_max_tokens=16)
    except FieldError as exc:
        raise pydantic(model_name, exc.field, exc.msg, exc.kind, exc.value) from None
    except ShapeError as exc:
        raise flat(str(exc), "BadRequestError", 400) from None
    ids = body.get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):  # the disaggregated server's
        req = ChatRequest(**{**{f: getattr(req, f) for f in req.__slots__}, "prompt": list(ids)})
    opts = body.get("stream_options")
    if isinstance(opts, dict):
        include = bool(opts.get("include_usage", True))
        req = ChatRequest(**{**{f: getattr(req, f) for f in req.__slots__}, "include_usage": include,
                             "continuous_usage": include and bool(opts.get("continuous_usage_stats", False))})
    limit = ctx.config.max_model_len
    if len(req.prompt) > limit:
        raise flat(f"The sum of prompt length ({len(req.prompt)}) and query length (0) should not exceed "
                    f"max_num_tokens ({limit})", "BadRequestError", 400)
    return req


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def generate(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT_KEY]
    chat = request.path.endswith("/chat/completions")
    ctx.stats.requests_received += 1
    try:
        req = _validate(ctx, await request.read(), chat=chat)
        admit(ctx)
    except Reject as rej:
        return json_response(rej.body, rej.status)
    model = str(req.body.get("model") or ctx.model)
    room = ctx.config.max_model_len - len(req.prompt)
    max_tokens = req.max_tokens if req.max_tokens is not None or ctx.profile.default_output_tokens <= room else room
    layout = hermes_layout(req.shape.tool.name, req.shape.json_text()) if req.shape.tool is not None else None
    text = layout.text if layout is not None else req.shape.json_text() if req.shape.kind == "json" else None
    plans = ctx.plans(req.n, max_tokens=max_tokens, stop=req.stop, text=text)
    leg = trtllm_pd.request_type(req.body)
    external, ctx_finish = 0, None
    if leg is not None and not ctx.handoffs:
        return json_response(flat(f"disaggregated_params {leg}: this server has no cache transceiver (start it "
                                  "with --role)", "BadRequestError", 400).body, 400)
    if leg == trtllm_pd.CONTEXT_ONLY:
        if req.stream:
            return json_response(flat("Context-only requests cannot be streamed", "BadRequestError", 400).body, 400)
        first, ctx_finish = trtllm_pd.context_plan(plans[0])
        plans = [first]
        req = ChatRequest(**{**{f: getattr(req, f) for f in req.__slots__}, "n": 1})
    elif leg == trtllm_pd.GENERATION_ONLY:
        try:
            external = await trtllm_pd.load_context(ctx, req.body, req.prompt)
        except trtllm_pd.LegFailed as exc:
            return json_response(flat(str(exc), "InternalServerError", 500).body, 500)
    gen = ctx.start(req.prompt, plans, external_tokens=external)
    try:
        if req.stream:
            return await _stream(ctx, request, req, gen, model, layout)
        texts: list[list[str]] = [[] for _ in plans]
        try:
            async for tok in stream_tokens(ctx, request, gen):
                texts[tok.choice].append(tok.piece)
        except Died:
            return web.Response(status=500)
        choices: list[dict[str, Any]] = []
        disagg = None
        if ctx_finish is not None:  # the context leg: its KV kept for the generation leg
            disagg = trtllm_pd.context_params(ctx, req.prompt, plans[0].token_ids[0], ctx_finish,
                                              req.body["disaggregated_params"].get("disagg_request_id"))
        for i, plan in enumerate(plans):
            out = "".join(texts[i])
            c: dict[str, Any] = {"index": i}
            finish = plan.finish_reason
            if chat and layout is not None and layout.complete(len(out)):
                call = {"id": f"chatcmpl-tool-{ctx.hex_id(32)}", "type": "function",
                        "function": {"name": layout.name, "arguments": layout.arguments}}
                c["message"] = {"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": [call]}
                finish = "tool_calls"
            elif chat:
                c["message"] = {"role": "assistant", "content": out, "reasoning_content": None, "tool_calls": []}
            else:
                c["text"] = out
            c.update(logprobs=None, finish_reason=ctx_finish or finish, stop_reason=plan.stop_reason,
                     disaggregated_params=disagg if i == 0 else None, avg_decoded_tokens_per_iter=1.0)
            choices.append(c)
        prefix = "chatcmpl-" if chat else "cmpl-"
        body: dict[str, Any] = {
            "id": prefix + ctx.hex_id(32), "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": _usage(len(req.prompt), sum(len(t) for t in texts), gen.cached_tokens)}
        if disagg is not None:
            body["prompt_token_ids"] = list(req.prompt)
        return json_response(body)
    finally:
        gen.abort()


async def _stream(
    ctx: FaceContext, request: web.Request, req: ChatRequest, gen: Generation, model: str,
    layout: ToolCallLayout | None,
) -> web.StreamResponse:
    rid = ("chatcmpl-" if req.chat else "cmpl-") + str(ctx.next_int())
    head = {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()), "model": model}
    counts = [0] * req.n
    resp = await open_sse(request)
    try:
        if req.chat:
            for i in range(req.n):
                first = {**head, "choices": [{"index": i, "delta": {"role": "assistant"}}]}
                # trtllm-serve writes its first chunk with a space before the blank line.
                await resp.write(b"data: " + orjson.dumps(first) + (b" \n\n" if i == 0 else b"\n\n"))
        trackers: dict[int, ToolCallStream] = {}
        async for tok in stream_tokens(ctx, request, gen, on_error_event=_error_event, resp=resp):
            counts[tok.choice] += 1
            if layout is not None and req.chat:
                tracker = trackers.setdefault(tok.choice, ToolCallStream(layout))
                for delta in _tool_deltas(ctx, tracker, tok.piece):
                    await resp.write(event({**head, "choices": [{"index": tok.choice, "delta": delta}]}))
                if tok.finished is not None:
                    finish = "tool_calls" if tracker.complete else gen.plans[tok.choice].finish_reason
                    end = {"index": tok.choice, "delta": {}, "finish_reason": finish}
                    await resp.write(event({**head, "choices": [end]}))
                continue
            choice: dict[str, Any] = {"index": tok.choice}
            if req.chat:
                choice["delta"] = {"content": tok.piece, "reasoning_content": ""}
            else:
                choice["text"] = tok.piece
            if tok.finished is not None:
                choice["finish_reason"] = gen.plans[tok.choice].finish_reason
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if req.continuous_usage:
                chunk["usage"] = _usage(len(req.prompt), counts[tok.choice], gen.cached_tokens)
            await resp.write(event(chunk))
        if req.include_usage:
            await resp.write(event({**head, "choices": [],
                                    "usage": _usage(len(req.prompt), sum(counts), gen.cached_tokens)}))
        await resp.write(DONE)
        await resp.write_eof()
    except (Died, ConnectionResetError):
        pass
    return resp


def _tool_deltas(ctx: FaceContext, tracker: ToolCallStream, piece: str) -> list[dict[str, Any]]:
    """trtllm-serve's DeltaToolCall deltas, serialised with exclude_none (estimated, not captured)."""
    name_now, fragment = tracker.feed(piece)
    deltas: list[dict[str, Any]] = []
    if name_now:
        first = {"id": f"chatcmpl-tool-{ctx.hex_id(32)}", "type": "function", "index": 0,
                 "function": {"name": tracker.layout.name}}
        deltas.append({"tool_calls": [first]})
    if fragment:
        deltas.append({"tool_calls": [{"type": "function", "index": 0, "function": {"arguments": fragment}}]})
    return deltas


def _error_event() -> bytes:
    # Estimated shape (not in the spec): an `error` key, so OpenAI clients raise as they do for vLLM.
    return event({"error": flat_error(500, "Internal server error", "InternalServerError")})


async def health(request: web.Request) -> web.Response:
    if request.app[CONTEXT_KEY].gate.ready():
        return web.Response(status=200)
    return web.Response(status=503, text="LLM is unavailable. Please check the server logs for more details.")


async def health_generate(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    if not ctx.gate.ready():
        return web.Response(status=500, text="Generation health check failed")
    gen = ctx.start([0], ctx.plans(1, max_tokens=1), health=True)
    try:
        async for _ in gen.tokens():
            pass
    finally:
        gen.abort()
    return web.Response(status=200, text="Generation health check OK")


async def version(request: web.Request) -> web.Response:
    return json_response({"version": VERSION})


async def models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    return json_response({"object": "list", "data": [
        {"id": ctx.model, "object": "model", "created": ctx.created, "owned_by": "tensorrt_llm"}]})


async def iteration_stats(request: web.Request) -> web.Response:
    return json_response(request.app[METRICS_KEY].drain())


async def prometheus(request: web.Request) -> web.Response:
    return render(request.app[METRICS_KEY].registry, request)


def build_app(ctx: FaceContext, metrics: TrtllmMetrics) -> web.Application:
    app = python_runtime_app()
    app[CONTEXT_KEY] = ctx
    app[METRICS_KEY] = metrics
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    if ctx.config.embedding_dim is not None:
        # An embedding model: trtllm-serve's register_embedding_routes (no generation, no stats).
        app.router.add_post("/v1/embeddings", trtllm_aux.embeddings)
        return app
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    trtllm_aux.add_routes(app)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/metrics", iteration_stats)
    app.router.add_get("/prometheus/metrics", prometheus)
    return app
