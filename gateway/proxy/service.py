"""choose -> adapter -> relay, with retries only before the first byte reaches the client.

The retry rule: an attempt may be retried (on a different backend, up to `retries.max_attempts`)
only while nothing has been sent to the client and only when the backend provably did no work or
never produced a first byte: connection refused/reset, 429, 503, or a first-token timeout. Once the
client's response has started, a failure ends the stream with an OpenAI error event instead.

Routing happens per attempt: `describe` the request once, pick the A/B arm once (sticky), then let
the route's policy choose among the arm's backends over a fresh snapshot. The routing memory (prefix
index, latency estimators) is told what was sent, when the first token came and what the engine
reported, so the next decision knows more.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from statistics import fmean

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_none

from backends.base import Endpoint, ErrorBody, TranslationError, UpstreamFormatError, Usage

from ..client.pool import (
    UpstreamClientError,
    UpstreamConnectError,
    UpstreamLocalExhaustion,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
)
from ..errors import (
    BackendConnectError,
    BackendError,
    BackendOverloaded,
    BackendProtocolError,
    BackendTimeout,
    BadGateway,
    GatewayError,
    GatewayOverloaded,
    GatewayTimeout,
    InvalidRequest,
    ModelNotFound,
    NoHealthyBackend,
    SlaUnattainable,
    UpstreamError,
)
from ..observability.metrics import NONE, Outcome, Recorder
from ..routing import POLICIES, BadRoutingHeader, Policy, RouteRequest, RoutingState, decide, describe
from ..routing.split import should_shadow
from ..settings import Route, Settings
from ..state.pool import BackendState, Pool
from ..state.splits import LiveSplit
from .deadlines import Deadlines
from .exchange import Exchange, sla_outcome
from .request import ParsedRequest, parse_request
from .sink import Reply
from .sse import DONE, SseRelay, StreamStats, error_event

log = logging.getLogger(__name__)

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
# statuses of responses the engine produced (its usage then corrects the prefix memory)
_RESPONSE_STARTED = frozenset({"200", "stream_error", "client_closed"})


@dataclass(slots=True)
class RouteState:
    config: Route
    policy: Policy
    split: LiveSplit | None = None
    seq: Iterator[int] = field(default_factory=itertools.count)


@dataclass(slots=True)
class Opened:
    """A backend response whose head (and, for streams, first bytes) arrived in time."""

    state: BackendState
    resp: UpstreamResponse
    first: bytes  # streams: the first bytes read; non-streams: the whole body


class ClientGone(Exception):
    """The client closed its connection while we were writing to it."""


class map_client_errors:  # used like the function it was; a class builds no generator per request
    """Re-raise upstream client failures as BackendError subclasses."""

    __slots__ = ("backend",)

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        backend = self.backend
        if isinstance(exc, TimeoutError):
            raise BackendTimeout(backend, "no response in time") from exc
        if isinstance(exc, UpstreamProtocolError):
            raise BackendProtocolError(backend, str(exc)) from exc
        if isinstance(exc, UpstreamLocalExhaustion):  # ours, not the backend's: no failure counted, no retry
            log.error("cannot open an upstream connection: %s", exc)
            raise GatewayOverloaded("The gateway is out of connections; try again shortly.") from exc
        if isinstance(exc, UpstreamConnectError):
            raise BackendConnectError(backend, str(exc)) from exc


def _first_event(data: bytes) -> tuple[bytes, bytes]:
    """`data` split after its first complete SSE event (the whole of it when there is one or none)."""
    end = data.find(b"\n\n") + 2
    return (data[:end], data[end:]) if 1 < end < len(data) else (data, b"")


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, BackendError) and exc.retryable


class Proxy:
    def __init__(
        self,
        settings: Settings,
        pool: Pool,
        recorder: Recorder,
        upstream: UpstreamPool,
        *,
        clock: Callable[[], float],
        rng: random.Random,
        wall_clock: Callable[[], float] = time.time,
        throughput: Callable[[str], float | None] | None = None,
        routing: RoutingState | None = None,
    ) -> None:
        """`throughput(backend)` gives measured output tokens/s (for the cost policy); `routing` is
        the routing memory, passed in so that it survives config reloads."""
        self._pool = pool
        self._recorder = recorder
        self._upstream = upstream
        self._clock = clock
        self._wall_clock = wall_clock
        self._rng = rng
        self._throughput = throughput
        self._routes = {
            r.model: RouteState(r, POLICIES[r.policy], LiveSplit(r) if r.split is not None else None)
            for r in settings.routes
        }
        self._timeouts = settings.timeouts
        self._max_attempts = settings.retries.max_attempts
        self.routing = routing if routing is not None else RoutingState()
        self._shadows: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()  # built inside the loop it serves
        self._deadlines = Deadlines(self._loop)

    @property
    def route_models(self) -> list[str]:
        return list(self._routes)

    def weights(self, model: str) -> dict[str, float]:
        """The live A/B weights of a split route (empty for other routes)."""
        route = self._routes.get(model)
        return route.split.weights if route is not None and route.split is not None else {}

    def set_weights(self, model: str, weights: Mapping[str, float]) -> dict[str, float]:
        route = self._routes.get(model)
        if route is None or route.split is None:
            raise KeyError(model)
        route.split.set_weights(weights)
        return route.split.weights

    async def serve(
        self, headers: Mapping[str, str], body: bytes, endpoint: Endpoint, reply: Reply, request_id: str
    ) -> None:
        """Serve one generation request; the response goes to `reply`. GatewayErrors raised here were
        recorded already and mean nothing was sent: the caller renders them."""
        ex = Exchange(request_id, self._clock())
        try:
            parsed = ex.parsed = parse_request(body, endpoint, created=int(self._wall_clock()))
            route = self._routes.get(parsed.model)
            if route is None:
                raise ModelNotFound(
                    f"The model `{parsed.model}` does not exist. Available models: {', '.join(self._routes)}.",
                    param="model",
                )
            ex.model = parsed.model
            try:
                ex.features = describe(parsed.request.body, endpoint, headers)
            except BadRoutingHeader as bad:
                raise InvalidRequest(str(bad), param=bad.header) from bad
            candidates = self._candidates(route, ex)
            opened = await self._open_with_retries(route, ex, candidates)
        except GatewayError as exc:
            self._finish(ex, str(exc.status))
            raise
        if route.split is not None and route.split.shadow is not None:
            self._maybe_shadow(route, route.split, ex)
        try:
            if parsed.request.stream:
                await self._relay_stream(reply, opened, ex)
            else:
                self._relay_body(reply, opened, ex)
        finally:
            opened.resp.close()
            opened.state.in_flight -= 1

    # -- choosing: arm once per request, backend once per attempt ------------------------------

    def _candidates(self, route: RouteState, ex: Exchange) -> list[str]:
        split = route.split
        if split is None:
            return route.config.candidates
        healthy = {s.name for s in self._pool if s.healthy}
        choice = split.choose(ex.features.sticky_key, healthy, self._rng)
        if choice is None:
            raise NoHealthyBackend(f"No arm of `{route.config.model}` has a healthy backend.")
        ex.arm = choice.arm
        self._recorder.arm_assigned(route.config.model, choice.arm, failed_over_from=(
            choice.preferred if choice.failed_over else None))
        return list(split.arm(choice.arm).backends)

    def _decide(self, route: RouteState, ex: Exchange, candidates: list[str]) -> BackendState:
        snapshot = self.routing.snapshot(self._pool.snapshot(candidates, self._throughput))
        req = RouteRequest(route.config.model, next(route.seq), frozenset(ex.tried), ex.features)
        decision = decide(route.policy, req, snapshot, self._rng)
        if decision is None:
            if ex.error is not None:
                raise self._exhausted(ex.error)
            raise NoHealthyBackend(f"No healthy backend for model `{route.config.model}`.")
        self._recorder.decision(route.config.model, route.policy.name, decision.reason)
        if decision.reject:
            retry_after = max(1, math.ceil(decision.retry_after_s or 1.0))
            raise SlaUnattainable(
                "No backend is predicted to meet the requested latency target (x-sla-strict).",
                retry_after_s=retry_after,
            )
        ex.decision = decision
        ex.tried.add(decision.backend)
        view = next(v for v in snapshot.backends if v.name == decision.backend)
        ex.ticket = self.routing.dispatched(view, ex.features)
        ex.last = self._pool[decision.backend]
        return ex.last

    # -- opening: send, wait for the first byte; retried ---------------------------------------

    async def _open_with_retries(self, route: RouteState, ex: Exchange, candidates: list[str]) -> Opened:
        assert ex.parsed is not None
        parsed = ex.parsed

        async def attempt() -> Opened:
            state = self._decide(route, ex, candidates)
            ex.sent_at = self._clock()
            try:
                opened = await self._open(state, parsed, ex.request_id)
            except BaseException as failure:  # incl. cancellation: every dispatched ticket is closed once
                assert ex.ticket is not None
                # the engine did work unless it refused outright (connect error, 429/503, 4xx, bad input)
                reached = isinstance(failure, BackendError) and not isinstance(
                    failure, BackendConnectError | BackendOverloaded
                )
                self.routing.failed(ex.ticket, reached_engine=reached)
                ex.ticket = None
                if isinstance(failure, BackendError):
                    ex.error = failure
                raise
            if parsed.request.stream and ex.ticket is not None:
                self.routing.first_token(ex.ticket, self._clock() - ex.sent_at)
            return opened

        # The first attempt runs outside tenacity: building a retry controller costs ~30 µs, more than
        # the rest of the routing, and almost every request succeeds at once. Only a retryable failure
        # hands the remaining attempts to tenacity, whose rule is the one above.
        try:
            return await attempt()
        except BackendError as exc:
            if not exc.retryable or self._max_attempts <= 1:
                raise self._exhausted(exc) from exc
            self._count_retry(exc)
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._max_attempts - 1),
            retry=retry_if_exception(_retryable),
            wait=wait_none(),
            reraise=True,
            before_sleep=self._count_retry_state,
        )
        try:
            return await retrying(attempt)
        except BackendError as exc:
            raise self._exhausted(exc) from exc

    def _count_retry_state(self, retry_state: RetryCallState) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(exc, BackendError):
            self._count_retry(exc)

    def _count_retry(self, exc: BackendError) -> None:
        state = self._pool[exc.backend]
        self._recorder.retry(state.name, state.runtime, type(exc).__name__)

    @staticmethod
    def _exhausted(exc: BackendError) -> GatewayError:
        if isinstance(exc, BackendOverloaded):
            return UpstreamError(exc.status, exc.error, headers={"Retry-After": "1"})
        if isinstance(exc, BackendTimeout):
            return GatewayTimeout(f"The backend did not answer in time ({exc.backend}).")
        if isinstance(exc, BackendConnectError):
            return NoHealthyBackend("No backend could be reached; try again shortly.")
        return GatewayError(f"The backend failed: {exc.detail}")

    async def _open(self, state: BackendState, parsed: ParsedRequest, request_id: str) -> Opened:
        adapter = state.adapter
        try:
            upstream = adapter.build_request(parsed.request, model=state.config.model, request_id=request_id)
        except TranslationError as untranslatable:
            raise InvalidRequest(str(untranslatable)) from untranslatable
        stream = parsed.request.stream
        timeouts = self._timeouts
        state.in_flight += 1
        resp: UpstreamResponse | None = None
        try:
            deadline = self._deadlines.after(timeouts.first_token_s if stream else timeouts.total_s)
            with map_client_errors(state.name), deadline:
                resp = await self._upstream.request(
                    state.base_url, "POST", upstream.path, upstream.headers, upstream.body
                )
                if resp.status >= 400:
                    self._upstream_error(state, resp.status, await resp.read())
                first = await resp.readany() if stream else await resp.read()
        except BaseException as exc:
            if resp is not None:
                resp.close()
            state.in_flight -= 1
            if isinstance(exc, BackendError):
                self._failed(state, exc.detail or type(exc).__name__)
            raise
        self._pool.record_success(state.name)
        return Opened(state, resp, first)

    def _upstream_error(self, state: BackendState, status: int, body: bytes) -> None:
        error = state.adapter.normalise_error(status, body)
        if status in (429, 503):
            raise BackendOverloaded(state.name, status, error)
        if status >= 500:
            self._failed(state, f"status {status}")
        raise UpstreamError(
            status, error,
            headers={"x-gateway-backend": state.name, "x-gateway-runtime": state.runtime},
        )

    def _failed(self, state: BackendState, detail: str) -> None:
        if self._pool.record_failure(state.name, self._clock(), detail):
            log.warning("backend %s ejected after repeated failures: %s", state.name, detail)
            self._recorder.ejected(state.name, state.runtime)
            self.routing.forget(state.name)  # whatever it cached may be gone by the time it returns

    # -- relaying ------------------------------------------------------------------------------

    def _headers(self, state: BackendState, ex: Exchange, content_type: str) -> dict[str, str]:
        headers = {
            "Content-Type": content_type,
            "x-gateway-backend": state.name,
            "x-gateway-runtime": state.runtime,
            "x-gateway-route-reason": ex.decision.reason if ex.decision else NONE,
            "x-request-id": ex.request_id,
        }
        if ex.arm is not None:
            headers["x-gateway-arm"] = ex.arm
        return headers

    def _relay_body(self, reply: Reply, opened: Opened, ex: Exchange) -> None:
        state, parsed = opened.state, ex.parsed
        assert parsed is not None
        try:
            translated = state.adapter.translate_response(
                parsed.request, opened.resp.status, opened.first, model=parsed.model, request_id=ex.request_id
            )
        except UpstreamFormatError as exc:
            self._failed(state, str(exc))
            self._finish(ex, "502")
            raise BadGateway(f"The backend's response could not be read: {exc}") from exc
        self._finish(ex, str(opened.resp.status), usage=translated.usage)
        reply.send(opened.resp.status, self._headers(state, ex, "application/json"), translated.body)

    async def _relay_stream(self, reply: Reply, opened: Opened, ex: Exchange) -> None:
        state, parsed = opened.state, ex.parsed
        assert parsed is not None
        translator = state.adapter.stream_translator(parsed.request, model=parsed.model, request_id=ex.request_id)
        relay = SseRelay(
            backend_model=parsed.model if translator is not None else state.config.model,
            client_model=parsed.model,
            include_usage=parsed.request.include_usage,
        )
        clock = self._clock
        status = "200"

        def translate(data: bytes) -> bytes:
            return relay.feed(translator.feed(data) if translator is not None else data, clock())

        async def send(data: bytes) -> None:
            out = translate(data)
            if out:
                try:
                    await reply.write(out)
                except ConnectionError as gone:
                    raise ClientGone from gone

        try:
            try:
                # The response head leaves with the first event, in one write. When the first read
                # holds more events (an engine that flushed several at once), the first goes out
                # before the rest are processed: the client's time to first token does not wait.
                first, rest = _first_event(opened.first)
                await reply.start(200, self._headers(state, ex, SSE_CONTENT_TYPE), translate(first))
                if rest:
                    await send(rest)
                remaining = self._timeouts.total_s - (clock() - ex.started)
                with map_client_errors(state.name), self._deadlines.after(max(remaining, 0.001)):
                    async for data in opened.resp:
                        await send(data)
                if translator is not None:
                    tail = relay.feed(translator.close(), clock()) + relay.close()
                    if tail:
                        await reply.write(tail)
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
                await reply.write(error_event(error) + DONE)
            await reply.end()
        except (ClientGone, ConnectionError):
            status = "client_closed"
        except asyncio.CancelledError:
            status = "client_closed"
            raise
        finally:
            self._finish(ex, status, stream=relay.stats)

    # -- accounting ------------------------------------------------------------------------------

    def _finish(
        self, ex: Exchange, status: str, *, usage: Usage | None = None, stream: StreamStats | None = None
    ) -> None:
        """Record the request's outcome exactly once and teach the routing memory what happened."""
        now = self._clock()
        duration = now - ex.started
        ttft = gaps = None
        if stream is not None:
            usage = stream.usage
            if usage is None and stream.events:
                usage = Usage(prompt_tokens=0, completion_tokens=max(stream.events - 1, 0))
            ttft = None if stream.first_event_at is None else stream.first_event_at - ex.started
            gaps = stream.gaps
        state = ex.last
        if ex.ticket is not None:  # an attempt that got a response: close its ticket exactly once
            if status in _RESPONSE_STARTED:
                self.routing.completed(
                    ex.ticket,
                    cached_tokens=usage.cached_tokens if usage else None,
                    prompt_tokens=usage.prompt_tokens if usage else None,
                    itl_s=fmean(gaps) if gaps else None,
                )
            else:
                self.routing.failed(ex.ticket, reached_engine=True)
            ex.ticket = None
        self._recorder.record(
            Outcome(
                state.name if state else NONE,
                state.runtime if state else NONE,
                ex.model,
                status,
                duration,
                usage,
                ttft,
                gaps or (),
                reason=ex.decision.reason if ex.decision else NONE,
                arm=ex.arm,
                sla=sla_outcome(
                    ex.features.sla, ok=status == "200", ttft_s=ttft, gaps_s=gaps or (), duration_s=duration,
                    usage=usage,
                ),
                finished_at=now,
            )
        )

    # -- shadow traffic ----------------------------------------------------------------------------

    def _maybe_shadow(self, route: RouteState, split: LiveSplit, ex: Exchange) -> None:
        shadow = split.shadow
        assert shadow is not None
        assert ex.parsed is not None
        if ex.arm == shadow.arm or not should_shadow(ex.request_id, shadow.fraction, self._rng):
            return
        task = asyncio.create_task(self._shadow(route, shadow.arm, ex.parsed, ex))
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    async def _shadow(self, route: RouteState, arm: str, parsed: ParsedRequest, origin: Exchange) -> None:
        """Send a copy to the shadow arm, read the answer to the end and discard it. Counted apart
        from client requests (`gateway_shadow_requests_total`), never seen by the client."""
        assert route.split is not None
        backends = list(route.split.arm(arm).backends)
        ex = Exchange(origin.request_id + "-shadow", self._clock(), model=origin.model, parsed=parsed,
                      features=origin.features, arm=arm)
        status = "error"
        try:
            state = self._decide(route, ex, backends)
            opened = await self._open(state, parsed, ex.request_id)
            try:
                body = opened.first + (await opened.resp.read() if parsed.request.stream else b"")
            finally:
                opened.resp.close()
                state.in_flight -= 1
            status = str(opened.resp.status)
            if not parsed.request.stream:
                usage = state.adapter.translate_response(
                    parsed.request, opened.resp.status, body, model=parsed.model, request_id=ex.request_id
                ).usage
            else:
                relay = SseRelay(backend_model=state.config.model, client_model=parsed.model, include_usage=True)
                translator = state.adapter.stream_translator(parsed.request, model=parsed.model,
                                                             request_id=ex.request_id)
                data = translator.feed(body) + translator.close() if translator is not None else body
                relay.feed(data, self._clock())
                usage = relay.stats.usage
            self._recorder.shadow(origin.model, ex.arm or NONE, status, usage)
            if ex.ticket is not None:  # the engine cached this prompt too: keep the routing memory true
                self.routing.completed(
                    ex.ticket, cached_tokens=usage.cached_tokens if usage else None,
                    prompt_tokens=usage.prompt_tokens if usage else None, itl_s=None,
                )
        except (GatewayError, BackendError, UpstreamFormatError, UpstreamClientError, TimeoutError) as exc:
            log.debug("shadow request %s failed: %s", ex.request_id, exc)
            self._recorder.shadow(origin.model, ex.arm or NONE, status, None)
            if ex.ticket is not None:
                self.routing.failed(ex.ticket, reached_engine=not isinstance(exc, BackendConnectError))
