"""The gateway's one exception tree, rendered as OpenAI error JSON.

GatewayError                      anything the client sees as an OpenAI error body
├── InvalidRequest      400       malformed JSON, wrong types, missing fields
├── BodyTooLarge        413
├── HeadersTooLarge     431       a request line, header field or header section over its limit
├── ModelNotFound       404       model_not_found (also: a model the client's key may not use)
├── Unauthorized        401       invalid_api_key / invalid_admin_token
├── Forbidden           403       admin writes with no admin token on a non-loopback listener, or
│                                 from a foreign Origin; admin reads through a foreign Host
├── UnsupportedMediaType 415      an admin write whose body is not typed application/json
├── RateLimited         429       rate_limit_exceeded, with Retry-After
├── WeightsConflict     409       a live weight change lost to one written first (with the winner)
├── RequestTimeout      408       headers or body not received in time
├── NoHealthyBackend    503       with Retry-After
└── UpstreamError       (status)  a backend's own error, normalised, with the backend's status

BackendError                      a failure talking to one backend (never shown raw to clients)
├── BackendConnectError           no connection, so nothing was sent: retryable
├── BackendOverloaded             429 / 503: the backend refused before any work: retryable
├── BackendResetError             the connection closed after the request was sent, before any
│                                 response: the engine may have generated, so never retried (502)
├── BackendTimeout                no first byte / no answer in time: not retried (504)
└── BackendProtocolError          a malformed or truncated response, a broken stream (502)

`retryable` is the one retry rule: only what provably never reached an engine. `blames_backend` says
whether the failure counts against the backend in outlier detection (an overloaded backend is
shedding load, not failing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from backends.base import ErrorBody

from . import json_codec


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | int | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> ErrorBody:
        return ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)

    def render(self) -> bytes:
        return json_codec.dumps(self.body().as_dict())


def retry_after(seconds: float) -> dict[str, str]:
    """`Retry-After` (whole seconds, for everyone) and `retry-after-ms` (what the OpenAI SDK reads first)."""
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class BodyTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class HeadersTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    code = "request_headers_too_large"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NoHealthyBackend(GatewayError):
    status = 503
    type = "server_error"
    code = "no_healthy_backend"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers=retry_after(retry_after_s))


class GatewayOverloaded(NoHealthyBackend):
    """The gateway itself ran out of a resource (file descriptors): a 503 + Retry-After like
    NoHealthyBackend, with its own code."""

    code = "gateway_overloaded"


class UpstreamError(GatewayError):
    """A backend answered with an error; the client gets its status and a normalised body."""

    def __init__(self, status: int, error: ErrorBody, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(error.message, param=error.param, headers=headers)
        self.status = status
        self.error = error

    def body(self) -> ErrorBody:
        return self.error


class BackendError(Exception):
    retryable = False
    blames_backend = True

    def __init__(self, backend: str, detail: str = "") -> None:
        super().__init__(f"{backend}: {detail}" if detail else backend)
        self.backend = backend
        self.detail = detail


class BackendConnectError(BackendError):
    retryable = True


class BackendResetError(BackendError):
    """The request was written and the connection closed before the response head. For a
    non-streaming generation the head comes last, so the engine may have done all the work: never
    resent (Envoy's `reset`, as opposed to `connect-failure`)."""


class BackendTimeout(BackendError):
    """No answer (or no first byte) in time. Not retried: the engine may be generating."""


class BackendOverloaded(BackendError):
    """429/503: the backend refused the request before doing any work."""

    retryable = True
    blames_backend = False

    def __init__(self, backend: str, status: int, error: ErrorBody) -> None:
        super().__init__(backend, f"status {status}: {error.message}")
        self.status = status
        self.error = error


class BackendProtocolError(BackendError):
    pass


class SlaUnattainable(GatewayError):
    """x-sla-strict: no backend is predicted to meet the target, so the caller may go elsewhere."""

    status = 429
    type = "rate_limit_error"
    code = "sla_unattainable"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, headers=retry_after(retry_after_s))


class BadGateway(GatewayError):
    status = 502
    type = "server_error"
    code = "bad_gateway"


class GatewayTimeout(GatewayError):
    status = 504
    type = "server_error"
    code = "upstream_timeout"


class Unauthorized(GatewayError):
    """No or a wrong `Authorization: Bearer` key where keys are configured (OpenAI's own shape)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def __init__(self, message: str, *, code: str = "invalid_api_key", challenge: str | None = None) -> None:
        super().__init__(message, headers={"WWW-Authenticate": challenge or 'Bearer realm="gateway"'})
        self.code = code


class Forbidden(GatewayError):
    """Authenticated or not, this caller may not do this (OpenAI's `permission_error`)."""

    status = 403
    type = "permission_error"

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


class UnsupportedMediaType(GatewayError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class RateLimited(GatewayError):
    """A key's requests- or tokens-per-minute budget is spent; `Retry-After` says when it refills."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, kind: str, retry_after_s: float,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message, headers={**(headers or {}), **retry_after(retry_after_s)})
        self.type = kind  # OpenAI says "requests" or "tokens"


class WeightsConflict(GatewayError):
    """A live weight change made on an older version of the route's weights than the store holds
    (another replica wrote first): not applied. The body is OpenAI's error plus the winning `record`."""

    status = 409
    type = "invalid_request_error"
    code = "weights_conflict"

    def __init__(self, message: str, *, record: Mapping[str, object]) -> None:
        super().__init__(message, param="weights")
        self.record = dict(record)

    def render(self) -> bytes:
        return json_codec.dumps({**self.body().as_dict(), "record": self.record})


class RequestTimeout(GatewayError):
    """The client did not send its request (headers or body) in time."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
