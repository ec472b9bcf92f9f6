"""Client authentication, per-key rate limits and the admin token.

Keys are stored as SHA-256 digests; a presented key is hashed and compared with every configured
digest by `hmac.compare_digest` (constant time, no early exit). The authenticated key travels with the
request (`proxy.exchange.Exchange.key`) and accounting charges its usage to it, once, at the end.

A key asking for a model it may not use gets 404 `model_not_found`, exactly as for a model that does
not exist: a key learns nothing about routes it has no access to (OpenAI answers the same way).

With no admin token configured, `/admin` and `/dashboard` stay open for reading, but writes (any
method but GET and HEAD: reload, live weights) are refused with 403 unless every address the gateway
listens on is a loopback one (`admin_writes_open`, set by the composition root once it is bound): a
gateway started with `--host 0.0.0.0` (the container image's default) cannot be reconfigured by
whoever reaches its port.

Against the operator's own browser (`access.browsers`): every admin write must be typed
`application/json` (415) and come from no foreign `Origin` (403 `foreign_origin`); without an admin
token, `/admin` and `/dashboard` answer only a `Host` naming loopback or an IP address (403
`untrusted_host`, not 421: the same request is served once a token is configured, so the refusal is
about who asks, not about where it was sent).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from backends.base import Endpoint

from ..errors import Forbidden, RateLimited, Unauthorized, UnsupportedMediaType
from ..merge_rules import Merge, declare
from ..observability.outcome import Outcome
from ..settings import ApiKey
from ..state.generations import Generations
from .browsers import json_typed, local_host, same_origin
from .ratelimit import Limiter, exact_wait_s, rate_headers

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# the models the authenticated key may use (None: all), for `/v1/models`
KEY_MODELS: web.RequestKey[list[str] | None] = web.RequestKey("api_key_models")
PUBLIC_PATHS: Final = frozenset({"/health", "/ready", "/openapi.json"})
READ_METHODS: Final = frozenset({"GET", "HEAD"})
ENDPOINT_PATHS: Final = {
    Endpoint.CHAT: "/v1/chat/completions", Endpoint.COMPLETIONS: "/v1/completions", Endpoint.RESPONSES: "/v1/responses",
    Endpoint.EMBEDDINGS: "/v1/embeddings", Endpoint.TOKENIZE: "/tokenize", Endpoint.DETOKENIZE: "/detokenize",
}
GENERATION_PATHS: Final = frozenset(ENDPOINT_PATHS.values())


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
    """Who may call: client keys and their rate limits, and the admin token. The generation endpoints
    are admitted by the dispatcher (`authenticate`, `limit`), which records every outcome; aiohttp's
    other paths go through `middleware`."""

    def __init__(self, generations: Generations, limiter: Limiter, registry: CollectorRegistry) -> None:
        self._generations = generations
        self._limiter = limiter
        # without an admin token, may admin writes be made? Only on a loopback-only listener (app.start)
        self.admin_writes_open = False
        self.key_requests = Counter(
            "gateway_key_requests", "Generation requests by client key id and outcome.", ("key", "status"),
            registry=registry,
        )
        self.key_tokens = Counter(
            "gateway_key_tokens",
            "Tokens by client key id (from usage; estimated where a request ended before its usage).",
            ("key", "kind"), registry=registry,
        )
        declare(Merge.SUM, "gateway_key_requests", "gateway_key_tokens")  # each worker counts its own requests

    def charge(self, key: ApiKey, outcome: Outcome) -> None:
        """Accounting's per-key hook: count the request and charge its tokens to the key's budget."""
        self.key_requests.labels(key.id, outcome.status).inc()
        usage = outcome.usage
        if usage is not None:
            self.key_tokens.labels(key.id, "prompt").inc(usage.prompt_tokens)
            self.key_tokens.labels(key.id, "completion").inc(usage.completion_tokens)
            self._limiter.charge(key, usage.prompt_tokens + usage.completion_tokens)

    def authenticate(self, headers: Mapping[str, str]) -> ApiKey | None:
        """The caller's key (None when keys are not configured); raises Unauthorized."""
        secrets = self._generations.current.secrets
        if not secrets.api_keys:
            return None
        token = bearer(headers)
        key = find_key(secrets.api_keys, token) if token is not None else None
        if key is None:
            raise Unauthorized(
                "Incorrect API key provided." if token else
                "You didn't provide an API key (Authorization: Bearer YOUR_KEY)."
            )
        return key

    async def limit(self, key: ApiKey) -> dict[str, str]:
        """Take one request from the key's budget (this process's, the gateway's or the fleet's, as
        the limiter is) and return OpenAI's `x-ratelimit-*` headers for the response (none for a key
        without limits); raises RateLimited (with them) when it is spent."""
        decision = await self._limiter.admit(key)
        headers = rate_headers(key, decision.levels) if key.requests_per_minute or key.tokens_per_minute else {}
        limited = decision.refused
        if limited is not None:
            wait, kind = limited
            raise RateLimited(f"Rate limit reached for key {key.id}; retry after {wait} s.",
                              kind=kind, retry_after_s=exact_wait_s(key, kind, decision.levels), headers=headers)
        return headers

    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in PUBLIC_PATHS or path in GENERATION_PATHS:  # the dispatcher admits generation requests
            return await handler(request)
        if path.startswith(("/admin", "/dashboard")):
            self.check_admin(path, request.headers, method=request.method)
            return await handler(request)
        if path.startswith("/v1/"):
            key = self.authenticate(request.headers)
            if key is not None:
                limits = await self.limit(key)
                request[KEY_MODELS] = key.models
                response = await handler(request)
                if limits and not response.prepared:
                    response.headers.update(limits)
                return response
        return await handler(request)

    def check_admin(self, path: str, headers: Mapping[str, str], *, method: str = "GET") -> None:
        admin_digest = self._generations.current.secrets.admin_digest
        write = method not in READ_METHODS
        if admin_digest is None:
            if not local_host(headers.get("host")):
                raise Forbidden(
                    "Without an admin token, /admin and /dashboard answer only requests addressed to "
                    "localhost or an IP address (this one names another host: DNS rebinding?). Use "
                    "http://127.0.0.1:PORT, or configure `auth.admin_token_sha256`.",
                    code="untrusted_host",
                )
            if write and not self.admin_writes_open:
                raise Forbidden(
                    "Admin writes are disabled: no admin token is configured and the gateway listens on a "
                    "non-loopback address. Configure `auth.admin_token_sha256` (or `auth.admin_token_file`), "
                    "or listen on loopback only (127.0.0.1 or ::1).",
                    code="admin_token_required",
                )
        else:
            token = admin_credential(headers)
            if token is None or not hmac.compare_digest(_digest(token), admin_digest.encode()):
                raise Unauthorized(
                    "A valid admin token is required (Authorization: Bearer, or Basic with the token "
                    "as the password).",
                    code="invalid_admin_token",
                    challenge='Basic realm="gateway admin"' if path.startswith("/dashboard") else None,
                )
        if write:
            check_admin_write(headers)


def check_admin_write(headers: Mapping[str, str]) -> None:
    """What a browser page cannot fake on another site's behalf: a JSON body type (a cross-site one
    needs a CORS preflight, never approved here) and the gateway's own `Origin`, when one is sent."""
    origin = headers.get("origin")
    if origin is not None and not same_origin(origin, headers.get("host")):
        raise Forbidden(f"Admin writes from another origin ({origin[:100]}) are refused.", code="foreign_origin")
    if not json_typed(headers):
        raise UnsupportedMediaType(
            "Admin writes must be sent with `Content-Type: application/json` (a body-less POST too).",
            param="content-type",
        )
