"""The vLLM 0.32 face: OpenAI chat/completions plus vLLM's auxiliary endpoints, shaped like the real
server's captured transcripts (started with `--enable-prefix-caching --enable-prompt-tokens-details`)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from backends.emulator import vllm_aux, vllm_pd
from backends.emulator import vllm_render as R
from backends.emulator.context import CONTEXT_KEY, FaceContext, Generation, Token
from backends.emulator.dp import BadRank, mark_served, served_rank_header, vllm_rank
from backends.emulator.exposition import render_text_latest
from backends.emulator.openai_common import (
    DONE,
    BodyError,
    ChatRequest,
    Died,
    FieldError,
    build_request,
    event,
    json_response,
    open_sse,
    parse_body,
    python_runtime_app,
    stream_tokens,
)
from backends.emulator.structured import ShapeError, ToolCallLayout, ToolCallStream, hermes_layout
from backends.emulator.textgen import OutputPlan
from backends.emulator.vllm_common import (
    METRICS_KEY,
    Reject,
    admit,
    bad,
    json_content_type_error,
    prompt_too_long,
)
from backends.emulator.vllm_metrics import VllmMetrics


def _validate(ctx: FaceContext, request: web.Request, raw: bytes, *, chat: bool) -> ChatRequest:
    wrong_type = json_content_type_error(request)
    if wrong_type is not None:
        raise wrong_type
    try:
        body = parse_body(raw)
    except BodyError as exc:
        raise Reject(400, R.validation_error(
            "json_invalid", f"body.{exc.pos}", "JSON decode error", "<dict of 0 items>", {"error": str(exc)})) from None
    field = "messages" if chat else "prompt"
    if field not in body:
        raise Reject(400, R.validation_error(
            "missing", f"body.{field}", "Field required", f"<dict of {len(body)} items>"))
    if chat and not isinstance(body["messages"], list):
        raise Reject(400, R.validation_error(
            "list_type", "body.messages", "Input should be a valid list", body["messages"]))
    model = body.get("model")
    if model and model != ctx.model:
        raise Reject(404, R.error_body(
            f"The model `{model}` does not exist. Valid aliases: {ctx.model}.", "NotFoundError", 404, "model"))
    temp = body.get("temperature")
    if isinstance(temp, int | float) and temp < 0:
        raise bad(f"temperature must be non-negative, got {float(temp)}. (parameter=temperature, value={float(temp)})",
                   "temperature")
    n = body.get("n")
    if isinstance(n, int) and n < 1:
        raise bad(f"n must be at least 1, got {n}.")
    if body.get("stream_options") and not body.get("stream"):
        raise bad("Stream options can only be defined when `stream=True`.", "stream_options")
    try:
        req = build_request(body, chat=chat, default_max_tokens=16)
    except FieldError as exc:
        raise Reject(400, R.validation_error(exc.kind, f"body.{exc.field}", exc.msg, exc.value)) from None
    except ShapeError as exc:  # a VLLMValidationError: its str() names the parameter
        raise bad(f"{exc} (parameter={exc.param})", exc.param) from None
    if req.max_tokens is not None and req.max_tokens < 1:
        raise bad(f"max_tokens must be at least 1, got {req.max_tokens}.", "max_tokens")
    limit = ctx.config.max_model_len
    max_field = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    if req.max_tokens is not None and req.max_tokens > limit:
        raise bad(
            f"{max_field}={req.max_tokens} cannot be greater than max_model_len={limit}. Please request fewer output "
            f"tokens. (parameter={max_field}, value={req.max_tokens})", max_field)
    if len(req.prompt) > limit:
        raise prompt_too_long(limit)
    return req


async def generate(request: web.Request) -> web.StreamResponse:
    ctx, metrics = request.app[CONTEXT_KEY], request.app[METRICS_KEY]
    chat = request.path.endswith("/chat/completions")
    ctx.stats.requests_received += 1
    try:
        req = _validate(ctx, request, await request.read(), chat=chat)
        admit(ctx, metrics)
    except Reject as rej:
        return json_response(rej.body, rej.status)
    try:
        rank = vllm_rank(request.headers, ctx.data_parallel_size)
    except BadRank as bad_rank:  # the engine client's ValueError: a 400, or an error event once streaming
        return await _refused(request, req, R.error_body(str(bad_rank), "BadRequestError", 400))
    room = ctx.config.max_model_len - len(req.prompt)
    max_tokens = req.max_tokens
    if max_tokens is None and ctx.profile.default_output_tokens > room:
        max_tokens = room
    max_tokens = None if max_tokens is None else max(1, min(max_tokens, room))
    layout = hermes_layout(req.shape.tool.name, req.shape.json_text()) if req.shape.tool is not None else None
    text = layout.text if layout is not None else req.shape.json_text() if req.shape.kind == "json" else None
    plans = ctx.plans(req.n, max_tokens=max_tokens, stop=req.stop, text=text)
    header_id = request.headers.get("X-Request-Id")
    rid = ("chatcmpl-" if chat else "cmpl-") + (header_id or ctx.hex_id(16))
    kv_params = req.body.get("kv_transfer_params")
    chosen = ctx.choose_rank(rank)
    try:  # a decode leg loads its prompt's KV first (the request waits, deferred, meanwhile)
        external = await vllm_pd.load_external(ctx, chosen, req.prompt, kv_params)
    except vllm_pd.LoadFailed as exc:
        return await _refused(request, req, R.error_body(f"KV load failed: {exc}", "InternalServerError", 500))
    gen = ctx.start(req.prompt, plans, chosen=chosen, external_tokens=external)
    mark_served(request, gen.rank, ctx.data_parallel_size)
    metrics.on_request(n=req.n, max_tokens=max_tokens if max_tokens is not None else room, engine=gen.rank)
    produce = vllm_pd.wants_remote_decode(ctx, kv_params)
    try:
        if req.stream:
            return await _stream(ctx, request, req, gen, rid, layout, produce=produce)
        return await _complete(ctx, request, req, gen, rid, layout, produce=produce)
    finally:
        gen.abort()
        if gen.finished[0] is not None:
            vllm_pd.store_shared(ctx, req.prompt)


def _kept_kv(ctx: FaceContext, req: ChatRequest, gen: Generation, rid: str) -> dict[str, Any] | None:
    """A prefill-only request capped by length keeps its KV and answers the params to reach it
    (NixlConnector's `request_finished`); one that stopped otherwise frees it: no params."""
    fin = gen.finished[0]
    if fin is None or fin.reason != "length":
        return None
    return vllm_pd.produced_params(ctx, gen.rank, f"{rid}-{ctx.hex_id(8)}", req.prompt)


async def _refused(request: web.Request, req: ChatRequest, error: dict[str, Any]) -> web.StreamResponse:
    """An error the engine raises when the request reaches it: a stream has already started then."""
    if not req.stream:
        return json_response(error, error["error"]["code"])
    resp = await open_sse(request)
    await resp.write(f"data: {json.dumps(error)}\n\n".encode())
    await resp.write(DONE)
    await resp.write_eof()
    return resp


def _finish(req: ChatRequest, plan: OutputPlan, layout: ToolCallLayout | None) -> str:
    """vLLM's finish reason: a complete forced call ends with "tool_calls" ("required") or "stop"
    (a named function), as in the captures."""
    if layout is not None and plan.finish_reason == "stop":
        return "stop" if req.shape.named else "tool_calls"
    return plan.finish_reason


def _fingerprint(ctx: FaceContext) -> str:
    return f"vllm-{R.VERSION}-{ctx.fingerprint_hash}"


def _created_cache(ctx: FaceContext, req: ChatRequest, cached: int) -> int | None:
    if not req.chat:
        return None
    bs = ctx.params.block_size
    return max(0, (len(req.prompt) // bs) * bs - cached)


async def _complete(
    ctx: FaceContext, request: web.Request, req: ChatRequest, gen: Generation, rid: str,
    layout: ToolCallLayout | None, *, produce: bool = False,
) -> web.StreamResponse:
    texts: list[list[str]] = [[] for _ in range(req.n)]
    try:
        async for tok in stream_tokens(ctx, request, gen):
            texts[tok.choice].append(tok.piece)
    except Died:
        return web.Response(status=500)
    choices = []
    for i, plan in enumerate(gen.plans):
        lp = R.logprobs_content(ctx.rng, texts[i], req.top_logprobs) if req.logprobs else None
        text = "".join(texts[i])
        if not req.chat:
            choices.append(R.completion_choice(i, text, plan.finish_reason, plan.stop_reason, lp))
            continue
        # A call cut short by max_tokens is not parsed: vLLM returns the raw text as content.
        calls = None
        if layout is not None and layout.complete(len(text)):
            calls = [R.tool_call(f"chatcmpl-tool-{ctx.hex_id(16)}", layout.name, layout.arguments)]
        choices.append(R.chat_choice(i, text, _finish(req, plan, layout), plan.stop_reason, lp, calls))
    completion = sum(len(t) for t in texts)
    created = _created_cache(ctx, req, gen.cached_tokens)
    use = R.usage(len(req.prompt), completion, gen.cached_tokens, created, full=True)
    body = R.full_response(req, rid, ctx.created, ctx.model, _fingerprint(ctx), choices, use)
    if produce:
        body["kv_transfer_params"] = _kept_kv(ctx, req, gen, rid)
    resp = json_response(body)
    orca = _orca_header(ctx, request.headers.get("endpoint-load-metrics-format", ""))
    if orca is not None:
        resp.headers["endpoint-load-metrics"] = orca
    return resp


def _orca_header(ctx: FaceContext, fmt: str) -> str | None:
    """vLLM's optional ORCA load report on non-streaming responses (spec 2.3)."""
    snap = ctx.snapshot()
    metrics = {"kv_cache_usage_perc": snap.kv_usage, "num_requests_waiting": float(snap.waiting)}
    if fmt.upper() == "TEXT":
        return "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in metrics.items())
    if fmt.upper() == "JSON":
        return "JSON " + json.dumps({"named_metrics": metrics})
    return None


async def _stream(
    ctx: FaceContext, request: web.Request, req: ChatRequest, gen: Generation, rid: str,
    layout: ToolCallLayout | None, *, produce: bool = False,
) -> web.StreamResponse:
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    head = {"id": rid, "object": obj, "created": ctx.created, "model": ctx.model}
    counts = [0] * req.n
    prompt = len(req.prompt)
    resp: web.StreamResponse | None = None
    trackers: dict[int, ToolCallStream] = {}

    def mid_stream_error() -> bytes:
        # vLLM writes this one event with json.dumps (spaces after separators).
        err = R.error_body("Internal server error", "InternalServerError", 500)
        return f"data: {json.dumps(err)}\n\n".encode()

    try:
        resp = await open_sse(request)
        started = False
        async for tok in stream_tokens(ctx, request, gen, on_error_event=mid_stream_error, resp=resp):
            if not started and req.chat:
                for i in range(req.n):
                    first: dict[str, Any] = {**head, "choices": [{
                        "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}]}
                    if req.continuous_usage:
                        first["usage"] = R.running_usage(prompt, 0)
                    first["prompt_token_ids"] = None
                    first["prompt_text"] = None
                    await resp.write(event(first))
            started = True
            counts[tok.choice] += 1
            if layout is not None and req.chat:
                await _tool_chunks(ctx, resp, req, head, trackers.setdefault(tok.choice, ToolCallStream(layout)),
                                   tok, gen.plans[tok.choice], layout)
                continue
            lp = R.logprobs_content(ctx.rng, [tok.piece], req.top_logprobs) if req.logprobs else None
            fin = tok.finished
            plan = gen.plans[tok.choice]
            choice: dict[str, Any]
            if req.chat:
                choice = {"index": tok.choice, "delta": {"content": tok.piece}, "logprobs": lp,
                          "finish_reason": plan.finish_reason if fin else None}
            else:
                choice = {"index": tok.choice, "text": tok.piece, "logprobs": lp,
                          "finish_reason": plan.finish_reason if fin else None, "stop_reason": None}
            if fin is not None:
                choice["stop_reason"] = plan.stop_reason
            if not req.chat:
                choice["prompt_token_ids"] = None
            choice["token_ids"] = None
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if req.continuous_usage:
                chunk["usage"] = R.running_usage(prompt, counts[tok.choice])
            if fin is not None and not req.include_usage:
                chunk["system_fingerprint"] = _fingerprint(ctx)
            await resp.write(event(chunk))
        if req.include_usage:
            use = R.usage(prompt, sum(counts), gen.cached_tokens, _created_cache(ctx, req, gen.cached_tokens),
                          full=False)
            await resp.write(event({**head, "choices": [], "usage": use, "system_fingerprint": _fingerprint(ctx)}))
        if produce:  # the blocks are kept as for a non-streaming leg; a stream carries no params
            _kept_kv(ctx, req, gen, rid)
        await resp.write(DONE)
        await resp.write_eof()
    except (Died, ConnectionResetError):
        pass
    return resp if resp is not None else web.Response(status=500)


async def _tool_chunks(
    ctx: FaceContext, resp: web.StreamResponse, req: ChatRequest, head: dict[str, Any], tracker: ToolCallStream,
    tok: Token, plan: OutputPlan, layout: ToolCallLayout,
) -> None:
    """vLLM's streamed tool call (captured: chat_tool_*_stream.txt): a delta with id and name once the
    parser knows the function, one delta per arguments fragment, nothing for the wrapper, then a
    separate empty-delta chunk with the finish reason."""
    name_now, fragment = tracker.feed(tok.piece)
    deltas = []
    if name_now:
        deltas.append(R.tool_name_delta(f"chatcmpl-tool-{ctx.hex_id(16)}", layout.name))
    if fragment:
        deltas.append(R.tool_args_delta(fragment))
    for delta in deltas:
        choice = {"index": tok.choice, "delta": delta, "logprobs": None, "finish_reason": None, "token_ids": None}
        await resp.write(event({**head, "choices": [choice]}))
    if tok.finished is not None:
        final: dict[str, Any] = {"index": tok.choice, "delta": {}, "logprobs": None,
                                 "finish_reason": _finish(req, plan, layout), "stop_reason": None, "token_ids": None}
        chunk: dict[str, Any] = {**head, "choices": [final]}
        if not req.include_usage:
            chunk["system_fingerprint"] = _fingerprint(ctx)
        await resp.write(event(chunk))


async def health(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    return web.Response(status=200 if ctx.gate.ready() else 503)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": R.VERSION})


async def models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    card = R.model_card(ctx.model, ctx.created, ctx.config.max_model_len, ctx.hex_id(16))
    return json_response({"object": "list", "data": [card]})


async def load(request: web.Request) -> web.Response:
    snap = request.app[CONTEXT_KEY].snapshot()
    return json_response({"server_load": snap.running + snap.waiting})


async def metrics_endpoint(request: web.Request) -> web.Response:
    return render_text_latest(request.app[METRICS_KEY].registry)


def build_app(ctx: FaceContext, metrics: VllmMetrics) -> web.Application:
    app = python_runtime_app()
    app[CONTEXT_KEY] = ctx
    app[METRICS_KEY] = metrics
    app.on_response_prepare.append(served_rank_header)
    pooling = ctx.config.embedding_dim is not None
    if not pooling:
        app.router.add_post("/v1/chat/completions", generate)
        app.router.add_post("/v1/completions", generate)
    vllm_aux.add_routes(app, pooling=pooling)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics_endpoint)
    return app
