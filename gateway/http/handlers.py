"""aiohttp handlers and the one error middleware that renders every failure as OpenAI error JSON."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from yarl import URL

from backends.base import Endpoint

from .. import json_codec
from ..errors import BodyTooLarge, GatewayError, InvalidRequest
from ..proxy.exchange import request_id as choose_request_id
from ..proxy.sink import AiohttpReply, Reply
from ..state.generations import Generations

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HTTP_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def json_response(obj: object, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=json_codec.dumps(obj), status=status, headers=headers, content_type="application/json")


def _error_response(exc: GatewayError, request: web.Request) -> web.Response:
    headers = dict(exc.headers)
    request_id = request.get("request_id") or request.headers.get("x-request-id")
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


def redact_url(url: str) -> str:
    """The URL without userinfo (credentials must never reach /admin output)."""
    parsed = URL(url)
    return str(parsed.with_user(None)) if parsed.user is not None or parsed.password is not None else url


class Handlers:
    """Request handlers. Each generation request runs on the config generation current when it
    arrived, held until its response (stream included) is finished."""

    def __init__(self, generations: Generations, registry: CollectorRegistry, *, serve_metrics: bool = True) -> None:
        self._generations = generations
        self._registry = registry
        self._serve_metrics = serve_metrics

    async def generate(
        self, headers: Mapping[str, str], body: bytes, endpoint: Endpoint, reply: Reply, request_id: str
    ) -> None:
        """A generation request, from whichever server carries it (auth is done by then)."""
        generation = self._generations.enter()
        try:
            await generation.proxy.serve(headers, body, endpoint, reply, request_id)
        finally:
            self._generations.leave(generation)

    async def _serve(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        request_id = request["request_id"] = choose_request_id(request.headers.get("x-request-id"))
        reply = AiohttpReply(request)
        await self.generate(request.headers, await request.read(), endpoint, reply, request_id)
        assert reply.response is not None
        return reply.response

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, Endpoint.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, Endpoint.COMPLETIONS)

    async def models(self, request: web.Request) -> web.Response:
        allowed = request.get("api_key_models")
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "gateway"}
            for m in self._generations.current.proxy.route_models
            if allowed is None or m in allowed
        ]
        return json_response({"object": "list", "data": data})

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

    async def admin_backends(self, request: web.Request) -> web.Response:
        backends = []
        generation = self._generations.current
        routing = generation.proxy.routing
        for s in generation.pool:
            load = s.load
            learned = routing.latency.get(s.name)
            backends.append({
                "name": s.name,
                "runtime": s.config.runtime.value,
                "url": redact_url(s.config.base_url),
                "model": s.config.model,
                "healthy": s.healthy,
                "probe_ok": s.probe_ok,
                "ejected": s.ejected,
                "consecutive_failures": s.consecutive_failures,
                "in_flight": s.in_flight,
                "load_score": s.view().load_score,
                "load": {
                    "running": load.running,
                    "waiting": load.waiting,
                    "kv_usage": load.kv_usage,
                    "prefix_hit_rate": load.prefix_hit_rate,
                    "block_size": load.block_size,
                },
                "usd_per_hour": s.config.usd_per_hour,
                "last_error": s.last_error,
                # what the routing memory believes (the inputs of prefix_affinity and sla)
                "routing": {
                    "cached_prefix_blocks": routing.index.size(s.name),
                    "backlog_tokens": learned.backlog_tokens if learned else 0.0,
                    "prefill_tokens_per_s": learned.prefill_tokens_per_s if learned else None,
                    "predicted_tpot_s": learned.tpot_s((load.running or s.in_flight) + 1) if learned else None,
                },
            })
        return json_response({"backends": backends, "generation": self._generations.current.number})

    def install(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        if self._serve_metrics:
            app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/admin/backends", self.admin_backends)
