"""Pieces shared by the three OpenAI-compatible faces (vLLM, SGLang, trtllm-serve): the parsed
request, body decoding, SSE framing and the disconnect-safe token loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from backends.emulator import embeddings as E
from backends.emulator import tokenizer
from backends.emulator.context import FaceContext, Generation, Token, abort_transport, tokenize_prompt
from backends.emulator.structured import TEXT, OutputShape, chat_shape

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What the faces need from a validated chat or completions request."""

    chat: bool
    body: dict[str, Any]
    prompt: list[int]
    n: int
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: bool
    top_logprobs: int
    shape: OutputShape = TEXT  # chat only: a forced tool call or JSON `response_format`


class BodyError(Exception):
    """The request body is not a JSON object; carries what a face needs to render its error."""

    def __init__(self, message: str, pos: int) -> None:
        super().__init__(message)
        self.pos = pos


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # Re-parse with the stdlib only to get its message and position (error path only).
        try:
            json.loads(raw)
        except json.JSONDecodeError as exc:
            raise BodyError(exc.msg, exc.pos) from None
        raise BodyError("JSON decode error", 0) from None
    if not isinstance(body, dict):
        raise BodyError("Input should be a valid dictionary", 0)
    return body


class FieldError(Exception):
    """A field has the wrong type; pydantic's error fields, for each face to render in its own shape."""

    def __init__(self, field: str, kind: str, msg: str, value: Any) -> None:
        super().__init__(msg)
        self.field, self.kind, self.msg, self.value = field, kind, msg, value


def _int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise FieldError(key, "int_type", "Input should be a valid integer", value)
    try:
        return int(value)
    except ValueError:
        raise FieldError(key, "int_parsing", "Input should be a valid integer, unable to parse string as an "
                         "integer", value) from None


def stop_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(str(v) for v in value)
    return ()


def build_request(body: dict[str, Any], *, chat: bool, default_max_tokens: int | None) -> ChatRequest:
    """Read the common fields of a body; raises `FieldError` for values of the wrong type and
    `structured.ShapeError` for a `tool_choice` that names no given tool."""
    if chat:
        messages = body.get("messages") or []
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise FieldError("messages", "list_type", "Input should be a valid list of message objects", messages)
        prompt = tokenizer.encode(tokenizer.render_chat(messages))
        max_tokens = _int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens")
    else:
        prompt = tokenize_prompt(body.get("prompt", ""))
        max_tokens = _int(body, "max_tokens") if "max_tokens" in body else default_max_tokens
    raw_opts = body.get("stream_options")
    opts: dict[str, Any] = raw_opts if isinstance(raw_opts, dict) else {}
    include_usage = bool(opts.get("include_usage", False))
    logprobs = body.get("logprobs")
    n = _int(body, "n")
    top = _int(body, "top_logprobs") if chat else None
    if not chat and logprobs is not None and not isinstance(logprobs, bool):
        top = _int(body, "logprobs")
    return ChatRequest(
        chat=chat, body=body, prompt=prompt, n=1 if n is None else max(1, n),
        max_tokens=max_tokens, stop=stop_list(body.get("stop")),
        stream=bool(body.get("stream", False)), include_usage=include_usage,
        continuous_usage=include_usage and bool(opts.get("continuous_usage_stats", False)),
        logprobs=bool(logprobs) if chat else logprobs is not None,
        top_logprobs=top or 0, shape=chat_shape(body) if chat else TEXT,
    )


def flat_error(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    """The error body SGLang and trtllm-serve answer: OpenAI's fields at the top level, marked by
    `"object": "error"` (not nested under `error` as OpenAI and vLLM nest them)."""
    return {"object": "error", "message": message, "type": err_type, "param": param, "code": status}


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
    await resp.prepare(request)
    return resp


def event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class Died(Exception):
    """The `die_after_tokens` fault fired: the connection is gone, write nothing more."""


async def stream_tokens(
    ctx: FaceContext, request: web.Request, gen: Generation, *, on_error_event: Callable[[], bytes] | None = None,
    resp: web.StreamResponse | None = None, trailer: bytes = DONE,
) -> AsyncIterator[Token]:
    """Yield the request's tokens, applying the mid-stream faults (`die_after_tokens` drops the
    connection; `error_after_tokens` writes `on_error_event()` then `trailer`, `[DONE]` for the
    OpenAI faces, nothing for Triton), raising Died in both cases; always aborts the engine request
    if the consumer stops early (client disconnect, handler cancelled, fault)."""
    faults = ctx.config.faults
    count = 0
    try:
        async for tok in gen.tokens():
            if faults.die_after_tokens is not None and count >= faults.die_after_tokens:
                ctx.stats.died_mid_stream += 1
                gen.abort()
                abort_transport(request)
                raise Died
            if (
                faults.error_after_tokens is not None and count >= faults.error_after_tokens
                and resp is not None and on_error_event is not None
            ):
                gen.abort()
                await resp.write(on_error_event() + trailer)
                raise Died
            count += 1
            yield tok
    finally:
        gen.abort()


async def run_pooling(ctx: FaceContext, request: web.Request, prompts: list[list[int]], *, dim: int,
                      encoding_format: str) -> E.Vectors | None:
    """An embeddings request: every input is one engine request (a prefill and one pooled output),
    run concurrently through the same scheduler as generation, so queueing, the prefix cache and
    timing apply. Returns each input's `dim`-vector in `encoding_format`, or None when a mid-stream
    fault fired (`Died`: the faces answer a bare 500); aborts what is left on any exit."""
    gens = [ctx.start(p, ctx.plans(1, max_tokens=1)) for p in prompts]

    async def drain(gen: Generation) -> None:
        async for _ in stream_tokens(ctx, request, gen):
            pass

    try:
        await asyncio.gather(*(drain(g) for g in gens))
    except Died:
        return None
    finally:
        for g in gens:
            g.abort()
    return [E.encode(E.vector(p, dim), encoding_format) for p in prompts]


@web.middleware
async def fastapi_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """FastAPI's bodies for unknown paths and wrong methods (vLLM, SGLang and trtllm-serve)."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, 405)


async def uvicorn_server_header(request: web.Request, response: web.StreamResponse) -> None:
    """The Python runtimes run under uvicorn, which sends `server: uvicorn`."""
    response.headers["Server"] = "uvicorn"


def python_runtime_app() -> web.Application:
    """An aiohttp app that looks like a FastAPI/uvicorn server at the HTTP level."""
    app = web.Application(middlewares=[fastapi_errors])
    app.on_response_prepare.append(uvicorn_server_header)
    return app
