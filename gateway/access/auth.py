"""Client authentication, per-key model permissions and rate limits, the admin token, body timeouts.

Keys are stored as SHA-256 digests; a presented key is hashed and compared with every configured
digest by `hmac.compare_digest` (constant time, no early exit). The authenticated key's id is put on
the request (`request["api_key"]`) and in a context variable for the rest of the request's task, so a
Recorder observer can charge the request's token usage to the key without the proxy knowing keys.

A key asking for a model it may not use gets 404 `model_not_found`, exactly as for a model that does
not exist: a key learns nothing about routes it has no access to (OpenAI answers the same way).
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from backends.base import Endpoint

from .. import json_codec
from ..errors import ModelNotFound, RateLimited, RequestTimeout, Unauthorized
from ..observability.metrics import NONE, Outcome, Recorder
from ..proxy.sink import Reply
from ..settings import ApiKey
from ..state.generations import Generations
from .ratelimit import KeyLimiter

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CURRENT_KEY: contextvars.ContextVar[ApiKey | None] = contextvars.ContextVar("gateway_api_key", default=None)
PUBLIC_PATHS = frozenset({"/health", "/ready", "/openapi.json"})
ENDPOINT_PATHS = {Endpoint.CHAT: "/v1/chat/completions", Endpoint.COMPLETIONS: "/v1/completions"}
GENERATION_PATHS = frozenset(ENDPOINT_PATHS.values())
# (headers with lower-case names, body, endpoint, reply, request id)
Dispatch = Callable[[dict[str, str], bytes, Endpoint, Reply, str], Awaitable[None]]


def _digest(secret: str) -> bytes:
    return ("sha256:" + hashlib.sha256(secret.encode()).hexdigest()).encode()


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def admin_credential(headers: Mapping[str, str]) -> str | None:
    """The admin token from `Authorization: Bearer T`, or from HTTP Basic auth with T as the password.

    Basic is accepted so that a browser can open `/dashboard`: on a 401 it prompts for credentials
    and then sends them with every request the page makes, including its polls of `/admin/*`.
    """
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic":
        return bearer(headers)
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    return decoded.partition(":")[2] or None


def find_key(keys: tuple[ApiKey, ...], presented: str) -> ApiKey | None:
    digest = _digest(presented)
    found = None
    for key in keys:  # every digest is compared: the time does not depend on which one matches
        if hmac.compare_digest(digest, key.key.encode()):
            found = key
    return found


def model_allowed(key: ApiKey | None, model: object) -> bool:
    return key is None or key.models is None or model in key.models


class Guard:
    def __init__(
        self, generations: Generations, limiter: KeyLimiter, recorder: Recorder, registry: CollectorRegistry,
        *, clock: Callable[[], float],
    ) -> None:
        self._generations = generations
        self._limiter = limiter
        self._recorder = recorder
        self._clock = clock
        self.key_requests = Counter(
            "gateway_key_requests", "Requests by client key id and outcome.", ("key", "status"), registry=registry
        )
        self.key_tokens = Counter(
            "gateway_key_tokens", "Tokens by client key id (from usage).", ("key", "kind"), registry=registry
        )

    def observe(self, outcome: Outcome) -> None:
        """Recorder observer: runs in the request's task, so CURRENT_KEY is the request's key."""
        key = CURRENT_KEY.get()
        if key is None:
            return
        self.key_requests.labels(key.id, outcome.status).inc()
        if outcome.usage is not None:
            self.key_tokens.labels(key.id, "prompt").inc(outcome.usage.prompt_tokens)
            self.key_tokens.labels(key.id, "completion").inc(outcome.usage.completion_tokens)
            self._limiter.charge(key, outcome.usage.prompt_tokens + outcome.usage.completion_tokens)

    def admit(self, path: str, headers: Mapping[str, str]) -> ApiKey | None:
        """Authenticate a `/v1/` request and apply its key's rate limit; the key (None when keys are
        not configured). Raises Unauthorized or RateLimited."""
        secrets = self._generations.current.secrets
        if not secrets.api_keys:
            return None
        token = bearer(headers)
        key = find_key(secrets.api_keys, token) if token is not None else None
        if key is None:
            self._reject(path, "401")
            raise Unauthorized(
                "Incorrect API key provided." if token else
                "You didn't provide an API key (Authorization: Bearer YOUR_KEY)."
            )
        limited = self._limiter.admit(key)
        if limited is not None:
            wait, kind = limited
            self.key_requests.labels(key.id, "429").inc()
            self._reject(path, "429")
            raise RateLimited(f"Rate limit reached for key {key.id}; retry after {wait} s.",
                              kind=kind, retry_after_s=wait)
        return key

    @staticmethod
    def check_model(key: ApiKey | None, path: str, body: bytes) -> None:
        """A key limited to some models gets 404 for the others, as if they did not exist."""
        if key is not None and key.models is not None and path in GENERATION_PATHS:
            model = _model_of(body)
            if isinstance(model, str) and not model_allowed(key, model):
                raise ModelNotFound(f"The model `{model}` does not exist.", param="model")

    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in PUBLIC_PATHS:
            return await handler(request)
        generation = self._generations.current
        if path.startswith(("/admin", "/dashboard")):
            self.check_admin(path, request.headers)
            return await handler(request)
        key = self.admit(path, request.headers) if path.startswith("/v1/") else None
        if key is not None:
            request["api_key"] = key.id
            request["api_key_models"] = key.models
        if request.method == "POST" and request.can_read_body:
            try:
                async with asyncio.timeout(generation.settings.limits.body_timeout_s):
                    body = await request.read()
            except TimeoutError:
                raise RequestTimeout("The request body was not received in time.") from None
            self.check_model(key, path, body)
        token_ctx = CURRENT_KEY.set(key)
        try:
            return await handler(request)
        finally:
            CURRENT_KEY.reset(token_ctx)

    def guarded(self, serve: Dispatch) -> Dispatch:
        """`serve` behind the key check, rate limit and model permission (for the native front, which
        has no middleware)."""

        async def dispatch(
            headers: dict[str, str], body: bytes, endpoint: Endpoint, reply: Reply, request_id: str
        ) -> None:
            path = ENDPOINT_PATHS[endpoint]
            key = self.admit(path, headers)
            self.check_model(key, path, body)
            CURRENT_KEY.set(key)  # the request runs in its own task: nothing to reset
            await serve(headers, body, endpoint, reply, request_id)

        return dispatch

    def check_admin(self, path: str, headers: Mapping[str, str]) -> None:
        admin_digest = self._generations.current.secrets.admin_digest
        if admin_digest is None:
            return
        token = admin_credential(headers)
        if token is None or not hmac.compare_digest(_digest(token), admin_digest.encode()):
            raise Unauthorized(
                "A valid admin token is required (Authorization: Bearer, or Basic with the token "
                "as the password).",
                code="invalid_admin_token",
                challenge='Basic realm="gateway admin"' if path.startswith("/dashboard") else None,
            )

    def _reject(self, path: str, status: str) -> None:
        if path in GENERATION_PATHS:  # every generation request is counted exactly once
            self._recorder.record(Outcome(NONE, NONE, NONE, status, 0.0))


def _model_of(body: bytes) -> object:
    try:
        parsed = json_codec.loads(body)
    except json_codec.JSONDecodeError:
        return None  # the proxy answers malformed JSON with its own 400
    return parsed.get("model") if isinstance(parsed, dict) else None
