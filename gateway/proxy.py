"""choose -> adapter -> relay, with retries only before the first byte reaches the client.

The retry rule: an attempt may be retried (on a different backend, up to `retries.max_attempts`)
only while nothing has been sent to the client and only when the backend provably did no work or
never produced a first byte: connection refused/reset, 429, 503, or a first-token timeout. Once the
client's response has started, a failure ends the stream with an OpenAI error event instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_none

from backends.base import Endpoint, ErrorBody, TranslationError, UpstreamFormatError, Usage

from .errors import (
    BackendConnectError,
    BackendError,
    BackendOverloaded,
    BackendProtocolError,
    BackendTimeout,
    BadGateway,
    GatewayError,
    GatewayTimeout,
    InvalidRequest,
    ModelNotFound,
    NoHealthyBackend,
    UpstreamError,
)
from .metrics import NONE, Outcome, Recorder
from .openai_head import ParsedRequest, parse_request
from .pool import BackendState, Pool
from .relay import DONE, SseRelay, error_event
from .routing import POLICIES, Policy, RouteRequest
from .settings import Route, Settings

log = logging.getLogger("gateway.proxy")

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


@dataclass(slots=True)
class RouteState:
    config: Route
    policy: Policy
    seq: Iterator[int] = field(default_factory=itertools.count)


@dataclass(slots=True)
class Opened:
    """A backend response whose head (and, for streams, first bytes) arrived in time."""

    state: BackendState
    reason: str
    resp: aiohttp.ClientResponse
    first: bytes  # streams: the first bytes read; non-streams: the whole body


@dataclass(slots=True)
class Attempts:
    """Per-request retry bookkeeping."""

    tried: set[str] = field(default_factory=set)
    last: BackendState | None = None
    error: BackendError | None = None


class ClientGone(Exception):
    """The client closed its connection while we were writing to it."""


@contextlib.contextmanager
def map_client_errors(backend: str) -> Iterator[None]:
    """Re-raise aiohttp failures as BackendError subclasses (timeouts first: aiohttp's timeout error
    is also a connection error)."""
    try:
        yield
    except TimeoutError as exc:
        raise BackendTimeout(backend, "no response in time") from exc
    except aiohttp.ClientPayloadError as exc:
        raise BackendProtocolError(backend, str(exc)) from exc
    except aiohttp.ClientResponseError as exc:
        raise BackendProtocolError(backend, str(exc)) from exc
    except aiohttp.ClientConnectionError as exc:
        raise BackendConnectError(backend, type(exc).__name__) from exc


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, BackendError) and exc.retryable


class Proxy:
    def __init__(
        self,
        settings: Settings,
        pool: Pool,
        recorder: Recorder,
        session: aiohttp.ClientSession,
        *,
        clock: Callable[[], float],
        rng: random.Random,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._wall_clock = wall_clock
        self._settings = settings
        self._pool = pool
        self._recorder = recorder
        self._session = session
        self._clock = clock
        self._rng = rng
        self._routes = {r.model: RouteState(r, POLICIES[r.policy]) for r in settings.routes}
        self._timeouts = settings.timeouts
        self._max_attempts = settings.retries.max_attempts

    @property
    def route_models(self) -> list[str]:
        return list(self._routes)

    async def serve(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = self._clock()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request["request_id"] = request_id
        attempts = Attempts()
        model = NONE
        try:
            parsed = parse_request(await request.read(), endpoint, created=int(self._wall_clock()))
            route = self._routes.get(parsed.model)
            if route is None:
                raise ModelNotFound(
                    f"The model `{parsed.model}` does not exist. Available models: {', '.join(self._routes)}.",
                    param="model",
                )
            model = parsed.model
            opened = await self._open_with_retries(route, parsed, request_id, attempts)
        except GatewayError as exc:
            self._record_failure(attempts.last, model, str(exc.status), started)
            raise
        state = opened.state
        try:
            if parsed.request.stream:
                return await self._relay_stream(request, opened, parsed, request_id, started)
            return self._relay_body(opened, parsed, request_id, started)
        finally:
            opened.resp.close()
            state.in_flight -= 1

    # -- opening: choose a backend, send, wait for the first byte; retried --------------------

    async def _open_with_retries(
        self, route: RouteState, parsed: ParsedRequest, request_id: str, attempts: Attempts
    ) -> Opened:
        async def attempt() -> Opened:
            decision = route.policy.choose(
                RouteRequest(route.config.model, next(route.seq), frozenset(attempts.tried)),
                self._pool.snapshot(route.config.candidates),
                self._rng,
            )
            if decision is None:
                if attempts.error is not None:
                    raise self._exhausted(attempts.error)
                raise NoHealthyBackend(f"No healthy backend for model `{route.config.model}`.")
            attempts.tried.add(decision.backend)
            state = attempts.last = self._pool[decision.backend]
            try:
                return await self._open(state, decision.reason, parsed, request_id)
            except BackendError as exc:
                attempts.error = exc
                raise

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._max_attempts),
            retry=retry_if_exception(_retryable),
            wait=wait_none(),
            reraise=True,
            before_sleep=self._count_retry,
        )
        try:
            return await retrying(attempt)
        except BackendError as exc:
            raise self._exhausted(exc) from exc

    def _count_retry(self, retry_state: RetryCallState) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(exc, BackendError):
            state = self._pool[exc.backend]
            self._recorder.retry(state.name, state.config.runtime.value, type(exc).__name__)

    @staticmethod
    def _exhausted(exc: BackendError) -> GatewayError:
        if isinstance(exc, BackendOverloaded):
            return UpstreamError(exc.status, exc.error, headers={"Retry-After": "1"})
        if isinstance(exc, BackendTimeout):
            return GatewayTimeout(f"The backend did not answer in time ({exc.backend}).")
        if isinstance(exc, BackendConnectError):
            return NoHealthyBackend("No backend could be reached; try again shortly.")
        return GatewayError(f"The backend failed: {exc.detail}")

    async def _open(self, state: BackendState, reason: str, parsed: ParsedRequest, request_id: str) -> Opened:
        adapter = state.adapter
        try:
            upstream = adapter.build_request(parsed.request, model=state.config.model, request_id=request_id)
        except TranslationError as exc:
            raise InvalidRequest(str(exc)) from exc
        stream = parsed.request.stream
        timeouts = self._timeouts
        state.in_flight += 1
        resp: aiohttp.ClientResponse | None = None
        try:
            with map_client_errors(state.name):
                async with asyncio.timeout(timeouts.first_token_s if stream else timeouts.total_s):
                    resp = await self._session.post(
                        state.config.base_url + upstream.path,
                        data=upstream.body,
                        headers=upstream.headers,
                        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s),
                    )
                    if resp.status >= 400:
                        self._upstream_error(state, resp.status, await resp.read())
                    first = await resp.content.readany() if stream else await resp.read()
        except BaseException as exc:
            if resp is not None:
                resp.close()
            state.in_flight -= 1
            if isinstance(exc, BackendError):
                self._failed(state, exc.detail or type(exc).__name__)
            raise
        self._pool.record_success(state.name)
        return Opened(state, reason, resp, first)

    def _upstream_error(self, state: BackendState, status: int, body: bytes) -> None:
        error = state.adapter.normalise_error(status, body)
        if status in (429, 503):
            raise BackendOverloaded(state.name, status, error)
        if status >= 500:
            self._failed(state, f"status {status}")
        raise UpstreamError(
            status, error,
            headers={"x-gateway-backend": state.name, "x-gateway-runtime": state.config.runtime.value},
        )

    def _failed(self, state: BackendState, detail: str) -> None:
        if self._pool.record_failure(state.name, self._clock(), detail):
            log.warning("backend %s ejected after repeated failures: %s", state.name, detail)
            self._recorder.ejected(state.name, state.config.runtime.value)

    # -- relaying ------------------------------------------------------------------------------

    def _headers(self, opened: Opened, request_id: str, content_type: str) -> dict[str, str]:
        return {
            "Content-Type": content_type,
            "x-gateway-backend": opened.state.name,
            "x-gateway-runtime": opened.state.config.runtime.value,
            "x-gateway-route-reason": opened.reason,
            "x-request-id": request_id,
        }

    def _relay_body(self, opened: Opened, parsed: ParsedRequest, request_id: str, started: float) -> web.Response:
        state = opened.state
        try:
            reply = state.adapter.translate_response(
                parsed.request, opened.resp.status, opened.first, model=parsed.model, request_id=request_id
            )
        except UpstreamFormatError as exc:
            self._failed(state, str(exc))
            self._record_failure(state, parsed.model, "502", started)
            raise BadGateway(f"The backend's response could not be read: {exc}") from exc
        self._recorder.record(
            Outcome(state.name, state.config.runtime.value, parsed.model, str(opened.resp.status),
                    self._clock() - started, reply.usage)
        )
        return web.Response(
            status=opened.resp.status, body=reply.body,
            headers=self._headers(opened, request_id, "application/json"),
        )

    async def _relay_stream(
        self, request: web.Request, opened: Opened, parsed: ParsedRequest, request_id: str, started: float
    ) -> web.StreamResponse:
        state = opened.state
        translator = state.adapter.stream_translator(parsed.request, model=parsed.model, request_id=request_id)
        relay = SseRelay(
            backend_model=parsed.model if translator is not None else state.config.model,
            client_model=parsed.model,
            include_usage=parsed.request.include_usage,
        )
        response = web.StreamResponse(headers=self._headers(opened, request_id, SSE_CONTENT_TYPE))
        await response.prepare(request)
        clock = self._clock
        status = "200"

        async def send(data: bytes) -> None:
            out = relay.feed(translator.feed(data) if translator is not None else data, clock())
            if out:
                try:
                    await response.write(out)
                except ConnectionError as exc:
                    raise ClientGone from exc

        try:
            try:
                await send(opened.first)
                remaining = self._timeouts.total_s - (clock() - started)
                with map_client_errors(state.name):
                    async with asyncio.timeout(max(remaining, 0.001)):
                        async for data in opened.resp.content.iter_any():
                            await send(data)
                if translator is not None:
                    tail = relay.feed(translator.close(), clock()) + relay.close()
                    if tail:
                        await response.write(tail)
                if relay.stats.error is not None:
                    status = "stream_error"
                elif not relay.stats.done:
                    raise BackendProtocolError(state.name, "stream ended before [DONE]")
            except BackendError as exc:
                status = "stream_error"
                self._failed(state, exc.detail or type(exc).__name__)
                message = "The backend timed out" if isinstance(exc, BackendTimeout) else "The backend failed"
                error = ErrorBody(message=f"{message} mid-stream ({exc.detail}).", type="server_error",
                                  code="upstream_stream_error")
                await response.write(error_event(error) + DONE)
            await response.write_eof()
        except (ClientGone, ConnectionError):
            status = "client_closed"
        except asyncio.CancelledError:
            status = "client_closed"
            raise
        finally:
            stats = relay.stats
            usage = stats.usage
            if usage is None and stats.events:
                usage = Usage(prompt_tokens=0, completion_tokens=max(stats.events - 1, 0))
            self._recorder.record(
                Outcome(
                    state.name, state.config.runtime.value, parsed.model, status, clock() - started, usage,
                    None if stats.first_event_at is None else stats.first_event_at - started, stats.gaps,
                )
            )
        return response

    def _record_failure(self, state: BackendState | None, model: str, status: str, started: float) -> None:
        backend, runtime = (state.name, state.config.runtime.value) if state else (NONE, NONE)
        self._recorder.record(Outcome(backend, runtime, model, status, self._clock() - started))
