"""One request Envoy sends where the picker chose: routed once, observed on its way back, recorded once.

The HTTP front's steps, without the bytes: authenticate and rate-limit the caller, parse the body
(`Proxy.parse`), let the route's policy and A/B arm choose (`Proxy.pick`), and then, where the HTTP
front relays the backend's answer, read what Envoy shows of it (status, body chunks) with the same
measuring code (`relay.ex_stream_relay`, the adapter's `translate_response`), so that accounting
(`Accounting.finish`, once, from `close`) records it as if it had passed through the HTTP front:
Prometheus, the live comparison, per-key budgets, routing memory and outlier detection alike.

What Envoy sends upstream is the client's body (pinned to a data-parallel rank where the backend
has ranks), with the gateway's upstream request id and the backend's credentials in the headers; the
response passes through unchanged. Not here: retries (Envoy sends once; a refused request is the
client's 503), the Responses-to-chat bridge and runtimes that need a translation (Triton: not picked),
tracing spans, and P/D disaggregation.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Mapping
from typing import Final
from urllib.parse import urlsplit

from backends.base import Endpoint, Runtime, UpstreamFormatError, UpstreamRequest
from backends.ranks import pinned

from ..access.auth import Guard
from ..errors import GatewayError
from ..proxy.accounting import Accounting
from ..proxy.exchange import Exchange, new_request_id, request_id
from ..proxy.relay import ex_stream_relay, stream_ended
from ..proxy.service import Proxy, proxy_of
from ..proxy.sse import StreamRelay
from ..state.generations import Generation, Generations
from ..state.pool import BackendState

log = logging.getLogger(__name__)

PATHS: Final = {
    "/v1/chat/completions": Endpoint.CHAT, "/v1/completions": Endpoint.COMPLETIONS,
    "/v1/responses": Endpoint.RESPONSES, "/v1/embeddings": Endpoint.EMBEDDINGS,
}
MAX_RESPONSE_BYTES: Final = 64 * 1024 * 1024  # a non-streaming answer read for its usage (kept no longer)
# the header Envoy's router adds to every response that came from an upstream (its local replies have none)
UPSTREAM_TIME: Final = "x-envoy-upstream-service-time"


class UnknownPath(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "unknown_url"


def endpoint_of(path: str) -> Endpoint:
    """The generation endpoint of a request path (its query string aside); 404 for any other path."""
    bare = path.split("?", 1)[0]
    endpoint = PATHS.get(bare)
    if endpoint is None:
        raise UnknownPath(f"Invalid URL ({bare}): the Endpoint Picker routes {', '.join(PATHS)}.")
    return endpoint


def address(state: BackendState) -> str:
    """The backend's `ip:port` as Envoy's ORIGINAL_DST cluster reads it."""
    url = urlsplit(state.base_url)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def pickable(subset: frozenset[str] | None) -> Callable[[BackendState], bool]:
    """Which backends the picker may choose: those Envoy can send the client's body to unchanged (not
    Triton, which needs a translation), inside Envoy's subset when it gave one."""
    if subset is None:
        return lambda s: s.runtime != Runtime.TRITON
    return lambda s: s.runtime != Runtime.TRITON and address(s) in subset


class Picking:
    """The picker's entry (one per process, like the HTTP front's `Dispatcher`)."""

    def __init__(self, generations: Generations, guard: Guard, accounting: Accounting, *,
                 clock: Callable[[], float]) -> None:
        self._generations = generations
        self._guard = guard
        self._accounting = accounting
        self._clock = clock

    async def route(self, headers: Mapping[str, str], body: bytes, subset: frozenset[str] | None) -> Picked:
        """Choose a backend for one request; a GatewayError raised is the client's answer, and the
        request is then already recorded (a 404 for a path that is not a generation is not one)."""
        endpoint = endpoint_of(headers.get(":path", ""))
        generation = self._generations.enter()
        ex = Exchange(request_id(headers.get("x-request-id")), endpoint, self._clock())
        try:
            key = ex.key = self._guard.authenticate(headers)
            if key is not None:
                ex.rate_headers = await self._guard.limit(key) or None
            proxy = proxy_of(generation)
            proxy.parse(ex, body, headers)
            state = proxy.pick(ex, headers, pickable(subset))
        except GatewayError as exc:
            ex.status = str(exc.status)
            if ex.rate_headers:  # the key's budgets go with every answer, errors included
                exc.headers = {**ex.rate_headers, **exc.headers}
            self.finish(ex, generation)
            raise
        except BaseException as failure:  # Envoy gave up on the stream (the client left), or a bug
            ex.status = "client_closed" if isinstance(failure, asyncio.CancelledError) else "500"
            self.finish(ex, generation)
            raise
        return Picked(ex, generation, proxy, state, body, self, auth=key is not None)

    def finish(self, ex: Exchange, generation: Generation) -> None:
        try:
            self._accounting.finish(ex)
        finally:
            self._generations.leave(generation)

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    @property
    def accounting(self) -> Accounting:
        return self._accounting


class Picked:
    """A routed request: what Envoy must send, and the observer of the answer until `close`."""

    def __init__(self, ex: Exchange, generation: Generation, proxy: Proxy, state: BackendState, body: bytes,
                 picking: Picking, *, auth: bool) -> None:
        self.ex = ex
        self.state = state
        self.endpoint = address(state)
        self._generation = generation
        self._proxy = proxy
        self._picking = picking
        self._clock = picking.clock
        self._status = 0
        self._relay: StreamRelay | None = None
        self._body = bytearray()
        self._first = True
        self._ended = False
        self._closed = False
        parsed = ex.parsed
        assert parsed is not None
        ex.upstream_id = new_request_id()  # the engine's request id is ours: never the client's
        upstream = state.adapter.build_request(parsed.request, model=state.config.model, request_id=ex.upstream_id)
        forwarded = UpstreamRequest(upstream.path, body, {})
        if ex.rank is not None and state.pin is not None:
            forwarded = pinned(forwarded, state.pin, ex.rank)
        # the request headers Envoy sets: the gateway's request id, the backend's key (when it has
        # one), a rank header; the gateway's own key never reaches the engine
        self.headers = {k.lower(): v for k, v in upstream.headers.items() if k.lower() != "content-type"}
        self.headers.update({k.lower(): v for k, v in forwarded.headers.items()})
        self.remove = ["authorization"] if auth and "authorization" not in self.headers else []
        self.body = forwarded.body if forwarded.body != body else None  # None: the client's, unchanged

    def response_headers(self, headers: Mapping[str, str], *, end: bool) -> dict[str, str]:
        """The backend's (or Envoy's) response head; returns the gateway's headers to add to it."""
        ex, state = self.ex, self.state
        try:
            status = self._status = int(headers.get(":status", "0"))
        except ValueError:
            status = self._status = 502
        ex.engine_worked = 0 < status < 400
        if status >= 400:
            self._error(status, local=UPSTREAM_TIME not in headers)
        elif ex.parsed is not None and ex.parsed.request.stream:
            self._relay = ex_stream_relay(ex, state.config.model)
            ex.status = "200"
        out = {
            "x-gateway-backend": state.name, "x-gateway-runtime": state.runtime,
            "x-gateway-route-reason": ex.decision.reason if ex.decision else "none", "x-request-id": ex.request_id,
        }
        if ex.arm is not None:
            out["x-gateway-arm"] = ex.arm
        if ex.ticket is not None:
            out["x-gateway-expected-cached-tokens"] = str(ex.ticket.expected_tokens)
        if ex.rate_headers:
            out.update(ex.rate_headers)
        if end:
            self.response_end()
        return out

    def _error(self, status: int, *, local: bool) -> None:
        """An error answer, judged as the HTTP front judges it: 429 and 503 are a backend shedding
        load (not counted against it; the engine did no work), other 5xx count against it. A 503 that
        Envoy made itself (no upstream answered) is a connection failure, which does count."""
        ex, state = self.ex, self.state
        ex.status, ex.verdict = str(status), None
        pool = ex.pool
        routing = self._proxy.routing
        if status in (429, 503):
            if ex.ticket is not None:
                routing.failed(ex.ticket, reached_engine=False)
                ex.ticket = None
            if local and pool is not None:
                self._picking.accounting.judge(pool, state, ok=False, detail="no connection (Envoy's local reply)")
        elif status >= 500 and pool is not None:
            self._picking.accounting.judge(pool, state, ok=False, detail=f"status {status}")

    def response_body(self, chunk: bytes, *, end: bool) -> None:
        """A chunk of the answer as Envoy passes it to the client."""
        now = self._clock()
        ex, relay = self.ex, self._relay
        if self._first and chunk:
            self._first = False
            if relay is not None and ex.ticket is not None:
                self._proxy.routing.first_token(ex.ticket, now - ex.sent_at)
        if relay is not None:
            relay.feed(chunk, now)  # measured; what it would send is not used: Envoy sends the bytes
        elif self._status < 400 and len(self._body) + len(chunk) <= MAX_RESPONSE_BYTES:
            self._body += chunk
        if end:
            self.response_end()

    def response_end(self) -> None:
        """The answer is complete (its last chunk or its trailers passed)."""
        if self._ended:
            return
        self._ended = True
        ex, relay = self.ex, self._relay
        if self._status >= 400 or self._status == 0:
            return
        if relay is not None:
            relay.close(self._clock())
            if not stream_ended(ex, relay.stats):
                ex.status, ex.verdict = "stream_error", False
            return
        parsed = ex.parsed
        assert parsed is not None
        try:
            reply = self.state.adapter.translate_response(parsed.request, self._status, bytes(self._body),
                                                          model=parsed.model, request_id=ex.request_id)
        except UpstreamFormatError as exc:
            log.info("request %s: the backend's answer could not be read: %s", ex.request_id, exc)
            ex.status, ex.verdict = "502", False
            return
        ex.usage = reply.usage
        ex.status, ex.verdict = str(self._status), True

    def close(self) -> None:
        """The ext_proc stream is over: record the request, exactly once. Before its answer ended, the
        client (or Envoy) gave up on it: client_closed, as the HTTP front counts a client gone."""
        if self._closed:
            return
        self._closed = True
        ex = self.ex
        if not self._ended:
            stream = ex.stream
            if not (stream is not None and stream.done and ex.status == "200"):
                ex.status, ex.verdict = "client_closed", None
        Proxy.release(ex)
        self._picking.finish(ex, self._generation)
