"""SGLang's `/v1/responses`, `/v1/embeddings`, `/v1/tokenize` and `/v1/detokenize` (each also
without the `/v1` prefix for the tokenizer endpoints), from SGLang's `srt/entrypoints/openai`
(`protocol.py`, `serving_responses.py`, `serving_embedding.py`, `serving_tokenize.py`) and
`managers/tokenizer_manager.py`:

* Responses: stored by default (`store: true`), so `previous_response_id` and `GET
  /v1/responses/{id}` work; `max_output_tokens` loses 2 tokens of headroom for BOS/EOS
  (`ResponsesRequest.to_sampling_params`).
* Embeddings need an embedding model (`--is-embedding`, here `embedding_dim`); a generative model
  answers the tokenizer manager's 400 "This model does not appear to be an embedding model ...".
* Tokenize takes `prompt` (a string or a list of strings) or `messages`, exactly one; answers
  `{tokens, count, max_model_len}`. Detokenize answers `{text}`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from backends.emulator import embeddings as E
from backends.emulator import responses_face as RF
from backends.emulator import tokenizer
from backends.emulator.context import CONTEXT_KEY, FaceContext, Generation
from backends.emulator.openai_common import BodyError, flat_error, json_response, parse_body, run_pooling
from backends.emulator.responses_api import ResponsesCall
from backends.emulator.responses_render import Dialect
from backends.emulator.sglang_common import METRICS_KEY, Reject, admit

NOT_EMBEDDING = ("This model does not appear to be an embedding model by default. Please add `--is-embedding` when "
                 "launching the server or try another model.")


def _flat(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    return json_response(flat_error(status, message, err_type, param), status)


def _too_long(ctx: FaceContext, prompt_tokens: int) -> web.Response | None:
    limit = ctx.config.max_model_len
    if prompt_tokens >= limit:
        return _flat(400, f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                     f"({limit} tokens).", "BadRequest")
    return None


def responses_hooks(app: web.Application) -> RF.ResponsesHooks:
    def admit_or_refuse(ctx: FaceContext) -> web.Response | None:
        try:
            admit(ctx)
        except Reject as rej:
            return json_response(rej.body(), rej.status)
        return None

    def on_submit(gen: Generation, call: ResponsesCall, max_tokens: int) -> None:
        app[METRICS_KEY].register(gen.rids, streaming=call.stream)

    return RF.ResponsesHooks(
        dialect=Dialect.SGLANG, reject=_flat,
        invalid_body=lambda exc: _flat(400, f"JSON decode error: {exc}", "Bad Request"),
        missing_input=lambda body: _flat(400, "1 validation error:\n  Field required: body.input", "Bad Request"),
        admit=admit_or_refuse, model=lambda ctx, body: str(body.get("model") or ctx.model),
        limits=lambda ctx, call: _too_long(ctx, len(call.prompt)), on_submit=on_submit,
        store=RF.ResponseStore(), max_tokens_headroom=2,
    )


async def embeddings(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    ctx.stats.requests_received += 1
    try:
        body = parse_body(await request.read())
    except BodyError as exc:
        return _flat(400, f"JSON decode error: {exc}", "Bad Request")
    if "input" not in body:
        return _flat(400, "1 validation error:\n  Field required: body.input", "Bad Request")
    if ctx.config.embedding_dim is None:
        return _flat(400, NOT_EMBEDDING, "BadRequest")
    model = str(body.get("model") or "default")
    if body.get("dimensions") is not None:
        return _flat(400, f"Model '{ctx.model}' does not support matryoshka representation, changing output "
                     "dimensions will lead to poor results.", "BadRequest")
    try:
        prompts = E.inputs(body["input"])
    except E.EmbeddingInputError as exc:
        return _flat(400, f"1 validation error:\n  {exc}: body.input", "Bad Request")
    for p in prompts:
        refused = _too_long(ctx, len(p))
        if refused is not None:
            return refused
    try:
        admit(ctx)
    except Reject as rej:
        return json_response(rej.body(), rej.status)
    data = await run_pooling(ctx, request, prompts, dim=ctx.config.embedding_dim,
                             encoding_format=str(body.get("encoding_format") or "float"))
    if data is None:
        return web.Response(status=500)
    return json_response(E.sglang_body(model, data, sum(len(p) for p in prompts)))


async def tokenize(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    try:
        body = parse_body(await request.read())
    except BodyError as exc:
        return _flat(400, f"JSON decode error: {exc}", "Bad Request")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        return _flat(400, "1 validation error:\n  Value error, Exactly one of 'prompt' or 'messages' must be "
                     "provided.", "Bad Request")
    tokens: list[int] | list[list[int]]
    count: int | list[int]
    if messages is not None:
        if not isinstance(messages, list):
            return _flat(400, "1 validation error:\n  Input should be a valid list: body.messages", "Bad Request")
        tokens = tokenizer.encode(tokenizer.render_chat(messages))
        count = len(tokens)
    elif isinstance(prompt, str):
        tokens = tokenizer.encode(prompt)
        count = len(tokens)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        tokens = [tokenizer.encode(p) for p in prompt]
        count = [len(t) for t in tokens]
    else:
        return _flat(400, f"Invalid prompt type: {type(prompt)}. Expected str or List[str].", "BadRequestError")
    return json_response({"tokens": tokens, "count": count, "max_model_len": ctx.config.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    try:
        body = parse_body(await request.read())
    except BodyError as exc:
        return _flat(400, f"JSON decode error: {exc}", "Bad Request")
    raw: Any = body.get("tokens")
    if not isinstance(raw, list):
        return _flat(400, "1 validation error:\n  Field required: body.tokens", "Bad Request")
    if not raw:
        return json_response({"text": ""})
    if all(isinstance(t, int) for t in raw):
        return json_response({"text": tokenizer.decode(raw)})
    if all(isinstance(t, list) and all(isinstance(x, int) for x in t) for t in raw):
        return json_response({"text": [tokenizer.decode(t) for t in raw]})
    return _flat(400, "Invalid input: 'tokens' must be a list of integers.", "BadRequestError")


def add_routes(app: web.Application) -> None:
    responses = RF.Endpoints(responses_hooks(app))
    if app[CONTEXT_KEY].config.embedding_dim is None:
        app.router.add_post("/v1/responses", responses.create)
        app.router.add_get("/v1/responses/{response_id}", responses.retrieve)
    app.router.add_post("/v1/embeddings", embeddings)
    for prefix in ("/v1", ""):
        app.router.add_post(prefix + "/tokenize", tokenize)
        app.router.add_post(prefix + "/detokenize", detokenize)
