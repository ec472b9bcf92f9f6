"""vLLM's endpoints beyond chat/completions: `/v1/responses`, `/v1/embeddings` (pooling models),
`/tokenize`, `/detokenize`, `/kv_event_sources` and the dev `/reset_prefix_cache`.

Shapes from the captures of a real vLLM 0.32 (tests/emulator/captures/vllm-0.32.0-cpu): the
Responses errors (missing `input`, unknown model, `max_output_tokens` too big), the embeddings body
and its errors (unknown model without "Valid aliases", `dimensions` on a non-Matryoshka model, the
seven-error validation message of a body without `input`), and `/kv_event_sources`.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from backends.emulator import embeddings as E
from backends.emulator import responses_face as RF
from backends.emulator import tokenizer
from backends.emulator import vllm_render as R
from backends.emulator.context import CONTEXT_KEY, FaceContext, Generation, tokenize_prompt
from backends.emulator.openai_common import BodyError, json_response, parse_body, run_pooling
from backends.emulator.responses_api import ResponsesCall
from backends.emulator.responses_render import Dialect
from backends.emulator.vllm_common import METRICS_KEY, Reject, admit, json_content_type_error, prompt_too_long


def _json_error(exc: BodyError) -> web.Response:
    return json_response(R.validation_error("json_invalid", f"body.{exc.pos}", "JSON decode error",
                                            "<dict of 0 items>", {"error": str(exc)}), 400)


def _reject(status: int, message: str, err_type: str, param: str | None) -> web.Response:
    return json_response(R.error_body(message, err_type, status, param), status)


def _model(ctx: FaceContext, body: dict[str, Any]) -> str | web.Response:
    model = body.get("model")
    if model and model != ctx.model:
        return _reject(404, f"The model `{model}` does not exist. Valid aliases: {ctx.model}.", "NotFoundError",
                       "model")
    return ctx.model


def _missing_input(body: dict[str, Any]) -> web.Response:
    """The body pydantic saw: without tools, `check_tool_usage` has already set `tool_choice` to
    "none" (so `{"model": ...}` is reported as a dict of 2 items, as captured)."""
    items = len(body) + (0 if body.get("tools") or "tool_choice" in body else 1)
    return json_response(R.validation_error("missing", "body.input", "Field required", f"<dict of {items} items>"),
                         400)


def responses_hooks(app: web.Application) -> RF.ResponsesHooks:
    def admit_or_refuse(ctx: FaceContext) -> web.Response | None:
        try:
            admit(ctx, app[METRICS_KEY])
        except Reject as rej:
            return json_response(rej.body, rej.status)
        return None

    def limits(ctx: FaceContext, call: ResponsesCall) -> web.Response | None:
        limit = ctx.config.max_model_len
        requested = call.max_output_tokens
        if requested is not None and requested > limit:
            return _reject(400, f"max_output_tokens={requested} cannot be greater than max_model_len={limit}. "
                           f"Please request fewer output tokens. (parameter=max_output_tokens, value={requested})",
                           "BadRequestError", "max_output_tokens")
        if len(call.prompt) > limit:
            rej = prompt_too_long(limit)
            return json_response(rej.body, rej.status)
        return None

    def on_submit(gen: Generation, call: ResponsesCall, max_tokens: int) -> None:
        app[METRICS_KEY].on_request(n=1, max_tokens=max_tokens)

    return RF.ResponsesHooks(
        dialect=Dialect.VLLM, reject=_reject, invalid_body=_json_error,
        missing_input=_missing_input,
        invalid_shape=lambda exc: _reject(400, f"{exc} (parameter={exc.param})", "BadRequestError", exc.param),
        admit=admit_or_refuse, model=_model, limits=limits, on_submit=on_submit,
    )


def add_responses_routes(app: web.Application) -> None:
    responses = RF.Endpoints(responses_hooks(app))

    async def create(request: web.Request) -> web.StreamResponse:
        wrong_type = json_content_type_error(request)
        if wrong_type is not None:
            return json_response(wrong_type.body, wrong_type.status)
        return await responses.create(request)

    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", responses.retrieve)
    app.router.add_post("/v1/responses/{response_id}/cancel", responses.retrieve)


# --- embeddings (an emulator started as a pooling model) -------------------------------------------
_MISSING_EMBEDDING_LOCS = ("input", "messages", "messages", "messages", "input", "messages", "input")


def _missing_embedding_input(body: dict[str, Any]) -> web.Response:
    """vLLM validates the body against each member of its embeddings request union (captured)."""
    items = "\n  ".join(repr({"type": "missing", "loc": f"body.{loc}", "msg": "Field required",
                              "input": f"<dict of {len(body)} items>"}) for loc in _MISSING_EMBEDDING_LOCS)
    return json_response(R.error_body(f"{len(_MISSING_EMBEDDING_LOCS)} validation errors:\n  {items}",
                                      "Bad Request", 400, "body.input"), 400)


async def embeddings(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    ctx.stats.requests_received += 1
    wrong_type = json_content_type_error(request)
    if wrong_type is not None:
        return json_response(wrong_type.body, wrong_type.status)
    try:
        body = parse_body(await request.read())
    except BodyError as exc:
        return _json_error(exc)
    if "input" not in body:
        return _missing_embedding_input(body)
    model = body.get("model")
    if model and model != ctx.model:
        return _reject(404, f"The model `{model}` does not exist.", "NotFoundError", None)
    if body.get("dimensions") is not None:
        return _reject(400, f"Model '{ctx.model}' does not support Matryoshka embeddings; dimensions must be unset "
                       f"(received dimensions={body['dimensions']}).", "BadRequestError", None)
    try:
        prompts = E.inputs(body["input"])
    except E.EmbeddingInputError as exc:
        return json_response(R.validation_error("list_type", "body.input", str(exc), body["input"]), 400)
    if any(len(p) > ctx.config.max_model_len for p in prompts):
        rej = prompt_too_long(ctx.config.max_model_len)
        return json_response(rej.body, rej.status)
    try:
        admit(ctx, request.app[METRICS_KEY])
    except Reject as rej:
        return json_response(rej.body, rej.status)
    data = await run_pooling(ctx, request, prompts, dim=ctx.config.embedding_dim or 1,
                             encoding_format=str(body.get("encoding_format") or "float"))
    if data is None:
        return web.Response(status=500)
    return json_response(E.vllm_body(f"embd-{ctx.hex_id(16)}", int(time.time()), ctx.model, data,
                                     sum(len(p) for p in prompts)))


# --- tokenizer and cache endpoints ------------------------------------------------------------------
async def tokenize(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    try:
        body = parse_body(await request.read())
    except BodyError as exc:
        return _json_error(exc)
    if "messages" in body:
        gp = bool(body.get("add_generation_prompt", True))
        text = tokenizer.render_chat(body["messages"] or [], add_generation_prompt=gp)
        ids = tokenizer.encode(text)
    else:
        ids = tokenize_prompt(body.get("prompt", ""))
    strs = [tokenizer.decode([i]) for i in ids] if body.get("return_token_strs") else None
    return json_response({"count": len(ids), "max_model_len": ctx.config.max_model_len, "tokens": ids,
                          "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    try:
        body = parse_body(await request.read())
    except BodyError:
        return json_response(R.error_body("Invalid JSON", "Bad Request", 400), 400)
    return json_response({"prompt": tokenizer.decode(int(t) for t in body.get("tokens", []))})


async def kv_event_sources(request: web.Request) -> web.Response:
    """The publisher config per DP rank (`{}` when KV events are off), as vLLM's `/kv_event_sources`."""
    ctx = request.app[CONTEXT_KEY]
    out = {}
    for r in ctx.ranks:
        source = getattr(r.kv_publisher, "source_config", None)
        if callable(source):
            out[str(r.rank)] = source()
    return json_response(out)


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """Dev endpoint (`VLLM_SERVER_DEV_MODE=1`): drop every cached block (one `AllBlocksCleared`)."""
    ctx = request.app[CONTEXT_KEY]
    for r in ctx.ranks:
        r.driver.engine.cache.clear()
        ctx.flush_kv_events(r.rank)
    return web.Response(status=200)


def add_routes(app: web.Application, *, pooling: bool) -> None:
    """The auxiliary routes; a pooling model serves `/v1/embeddings`, a generative one `/v1/responses`
    (the other answers FastAPI's 404 `{"detail": "Not Found"}`, as captured)."""
    if pooling:
        app.router.add_post("/v1/embeddings", embeddings)
    else:
        add_responses_routes(app)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
