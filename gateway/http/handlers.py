"""aiohttp handlers and the one error middleware that renders every failure as OpenAI error JSON."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from backends.base import Endpoint

from .. import json_codec
from ..access.auth import KEY_MODELS
from ..errors import BodyTooLarge, GatewayError, InvalidRequest, ModelNotFound, RequestTimeout
from ..proxy.exchange import request_id as choose_request_id
from ..proxy.sink import Entry
from ..state.generations import Generations
from .aiohttp_sink import AiohttpSink

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id")
_HTTP_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def json_response(obj: object, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=json_codec.dumps(obj), status=status, headers=headers, content_type="application/json")


def _error_response(exc: GatewayError, request: web.Request) -> web.Response:
    headers = dict(exc.headers)
    request_id = request.get(REQUEST_ID) or request.headers.get("x-request-id")
    if request_id:
        headers["x-request-id"] = request_id
    response = web.Response(body=exc.render(), status=exc.status, headers=headers, content_type="application/json")
    if exc.status in (408, 413):  # the rest of the body is not worth waiting for
        response.force_close()
    return response


async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except GatewayError as failure:
        return _error_response(failure, request)
    except web.HTTPRequestEntityTooLarge as too_large:
        return _error_response(BodyTooLarge(f"Request body too large: {too_large.text}"), request)
    except web.HTTPException as http:
        if http.status < 400:
            raise
        error = GatewayError(http.reason if http.status != 404 else f"Unknown path: {request.path}")
        error.status = http.status
        error.type = _HTTP_ERROR_TYPES.get(http.status, "invalid_request_error")
        response = _error_response(error, request)
        if http.status == 405 and "Allow" in http.headers:
            response.headers["Allow"] = http.headers["Allow"]
        return response
    except UnicodeDecodeError:
        return _error_response(InvalidRequest("Request body is not valid UTF-8."), request)


class Handlers:
    """aiohttp's handlers. Generation requests on connections aiohttp owns go to the same `Entry` the
    native front uses; a body that does not arrive in time or is too large is refused and counted."""

    def __init__(
        self, generations: Generations, entry: Entry, registry: CollectorRegistry, *, body_timeout_s: float,
        serve_metrics: bool = True,
    ) -> None:
        self._generations = generations
        self._entry = entry
        self._registry = registry
        self._body_timeout_s = body_timeout_s
        self._serve_metrics = serve_metrics
        self._created = int(time.time())  # the models' `created`: when this gateway started serving them

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        request_id = request[REQUEST_ID] = choose_request_id(request.headers.get("x-request-id"))
        try:
            async with asyncio.timeout(self._body_timeout_s):
                body = await request.read()
        except TimeoutError:
            self._entry.refused(endpoint, 408, request_id)
            raise RequestTimeout("The request body was not received in time.") from None
        except web.HTTPRequestEntityTooLarge as too_large:
            self._entry.refused(endpoint, 413, request_id)
            raise BodyTooLarge(f"Request body too large: {too_large.text}") from None
        sink = AiohttpSink(request)
        await self._entry.dispatch(request.headers, body, endpoint, sink, request_id)
        assert sink.response is not None
        return sink.response

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.RESPONSES)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.EMBEDDINGS)

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.TOKENIZE)

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.DETOKENIZE)

    def _cards(self, allowed: object) -> list[dict[str, Any]]:
        """One OpenAI model object per route the caller may use, with the smallest context length
        (`max_model_len`) of its healthy backends: what a request may be sure to fit (null when none
        of them reports or configures one)."""
        generation = self._generations.current
        pool = generation.pool
        cards = []
        for route in generation.settings.routes:
            if isinstance(allowed, list) and route.model not in allowed:
                continue
            lengths = []
            for name in pool.expand(route.candidates):  # discovery pools stand for their members
                state = pool[name]
                length = state.config.max_model_len or state.max_model_len
                if state.healthy and length:
                    lengths.append(length)
            cards.append({"id": route.model, "object": "model", "created": self._created, "owned_by": "gateway",
                          "max_model_len": min(lengths) if lengths else None})
        return cards

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": self._cards(request.get(KEY_MODELS))})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        card = next((c for c in self._cards(request.get(KEY_MODELS)) if c["id"] == name), None)
        if card is None:
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        return json_response(card)

    async def health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if self._generations.current.pool.any_healthy():
            return json_response({"status": "ready"})
        return json_response({"status": "not ready", "reason": "no healthy backend"}, status=503,
                             headers={"Retry-After": "1"})

    async def metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self._registry), headers={"Content-Type": content_type})

    def install(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        if self._serve_metrics:
            app.router.add_get("/metrics", self.metrics)
