"""trtllm-serve's `/v1/responses` (+ `GET`/`DELETE /v1/responses/{id}`), `POST /kv_cache_events` and
the embedding-model role, as `tensorrt_llm/serve/openai_server.py` registers them:

* the LLM role serves chat, completions and Responses (stored by default: `previous_response_id`,
  GET and DELETE work; an id not starting with `resp` is a 400, an unknown one a 404), and no
  `/v1/embeddings` or `/tokenize` (FastAPI's 404 `{"detail": "Not Found"}`);
* an embedding model (`register_embedding_routes`) serves only `/health`, `/version`, `/v1/models`
  and `/v1/embeddings`;
* request bodies are strict (`extra="forbid"`): an unknown Responses field is a 400 with pydantic's
  message as a string.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from backends.emulator import embeddings as E
from backends.emulator import responses_face as RF
from backends.emulator.context import CONTEXT_KEY, FaceContext
from backends.emulator.openai_common import BodyError, flat_error, json_response, parse_body, run_pooling
from backends.emulator.responses_api import ResponsesCall
from backends.emulator.responses_render import Dialect
from backends.emulator.trtllm_common import Reject, admit, flat, pydantic
from backends.emulator.trtllm_kv_events import TrtllmKvEventQueue

RESPONSES_FIELDS = frozenset({
    "background", "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model",
    "parallel_tool_calls", "previous_response_id", "prompt", "reasoning", "service_tier", "store", "stream",
    "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user", "request_id",
    "priority", "stream_options",
})


def _json(rej: Reject) -> web.Response:
    return json_response(rej.body, rej.status)


def _reject(status: int, message: str, err_type: str, param: str | None) -> web.Response:
    return json_response(flat_error(status, message, err_type, param), status)


def responses_hooks() -> RF.ResponsesHooks:
    def admit_or_refuse(ctx: FaceContext) -> web.Response | None:
        try:
            admit(ctx)
        except Reject as rej:
            return _json(rej)
        return None

    def limits(ctx: FaceContext, call: ResponsesCall) -> web.Response | None:
        limit = ctx.config.max_model_len
        if len(call.prompt) > limit:
            return _json(flat(f"The sum of prompt length ({len(call.prompt)}) and query length (0) should not exceed "
                              f"max_num_tokens ({limit})", "BadRequestError", 400))
        return None

    return RF.ResponsesHooks(
        dialect=Dialect.TRTLLM, reject=_reject,
        invalid_body=lambda exc: json_response({"error": f"JSON decode error: {exc}"}, 400),
        missing_input=lambda body: _json(pydantic("ResponsesRequest", "input", "Field required", "missing", body)),
        admit=admit_or_refuse, model=lambda ctx, body: ctx.model, limits=limits,
        unknown_field=lambda key, body: _json(pydantic("ResponsesRequest", key, "Extra inputs are not permitted",
                                                       "extra_forbidden", body[key])),
        allowed_fields=RESPONSES_FIELDS, store=RF.ResponseStore(16),
    )


async def kv_cache_events(request: web.Request) -> web.Response:
    """Drains the event queue (`[]` when events are off or nothing happened within the timeout)."""
    queue = request.app[CONTEXT_KEY].kv_publisher
    events: list[dict[str, Any]] = await queue.drain() if isinstance(queue, TrtllmKvEventQueue) else []
    return json_response(events)


async def embeddings(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    ctx.stats.requests_received += 1
    try:
        body = parse_body(await request.read())
    except BodyError as exc:
        return json_response({"error": f"JSON decode error: {exc}"}, 400)
    for key in ("model", "input"):
        if key not in body:
            return _json(pydantic("EmbeddingRequest", key, "Field required", "missing", body))
    if body.get("dimensions") is not None:
        return _json(flat(f"Model '{ctx.model}' does not support Matryoshka embeddings; dimensions must be unset.",
                          "BadRequestError", 400))
    try:
        prompts = E.inputs(body["input"])
    except E.EmbeddingInputError as exc:
        return _json(pydantic("EmbeddingRequest", "input", str(exc), "union_tag_invalid", body["input"]))
    try:
        admit(ctx)
    except Reject as rej:
        return _json(rej)
    data = await run_pooling(ctx, request, prompts, dim=ctx.config.embedding_dim or 1,
                             encoding_format=str(body.get("encoding_format") or "float"))
    if data is None:
        return web.Response(status=500)
    return json_response(E.trtllm_body(f"embd-{ctx.hex_id(32)}", int(time.time()), str(body["model"]), data,
                                       sum(len(p) for p in prompts)))


def add_routes(app: web.Application) -> None:
    """Routes beyond chat/completions for the LLM role (the embedding role registers `embeddings`)."""
    responses = RF.Endpoints(responses_hooks())
    app.router.add_post("/v1/responses", responses.create)
    app.router.add_get("/v1/responses/{response_id}", responses.retrieve)
    app.router.add_delete("/v1/responses/{response_id}", responses.delete)
    app.router.add_post("/kv_cache_events", kv_cache_events)
