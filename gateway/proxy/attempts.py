"""Choose a backend, send the request, wait for its response head (and a stream's first bytes):
one loop that retries only what provably never reached an engine.

The retry rule, in one place (`BackendError.retryable`): an attempt is retried, on a backend not
tried yet and up to `retries.max_attempts`, only when the connection could not be opened (nothing
was sent) or the backend answered 429/503 (it refused before doing any work). A connection that
closes after the request was written, a timeout and a 5xx are not retried: the engine may have
generated, and a generation is never run twice. Nothing has reached the client while this runs.

Why a hand-written loop and not tenacity: building a retry controller costs ~30 µs, more than the
rest of the routing decision, for a loop of four lines whose only policy is the rule above.

Every attempt's routing ticket is closed exactly once: here when the attempt fails (cancellation
included), or by accounting at the end of the response it opened.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from backends.base import Adapter, TranslationError
from backends.ranks import pinned
from backends.responses_bridge import ResponsesBridge

from ..client import (
    UpstreamConnectError,
    UpstreamLocalExhaustion,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResetError,
    UpstreamResponse,
)
from ..errors import (
    BackendConnectError,
    BackendError,
    BackendOverloaded,
    BackendProtocolError,
    BackendResetError,
    BackendTimeout,
    BadGateway,
    GatewayError,
    GatewayOverloaded,
    GatewayTimeout,
    InvalidRequest,
    NoHealthyBackend,
    SlaUnattainable,
    UpstreamError,
    retry_after,
)
from ..observability.metrics import Recorder
from ..routing import RouteRequest, RoutingState, Snapshot, decide
from ..settings import Timeouts
from ..state.pool import BackendState, Pool
from .accounting import Accounting
from .deadlines import Deadlines
from .exchange import Exchange, new_request_id
from .routes import RouteState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Opened:
    """A backend response whose head (and, for streams, first bytes) arrived in time."""

    state: Final[BackendState]
    resp: Final[UpstreamResponse]
    first: Final[bytes]  # streams: the first bytes read; non-streams: the whole body
    adapter: Final[Adapter]  # what built the request and reads the answer (the backend's, or the Responses bridge)
    rank: Final[int | None]  # the data-parallel rank it was pinned to

    def __init__(self, state: BackendState, resp: UpstreamResponse, first: bytes, adapter: Adapter,
                 rank: int | None = None) -> None:
        self.state = state
        self.resp = resp
        self.first = first
        self.adapter = adapter
        self.rank = rank

    def release(self) -> None:
        """The response is over: it no longer counts in its backend's (and rank's) in-flight requests."""
        self.state.in_flight -= 1
        if self.rank is not None:
            self.state.rank_in_flight[self.rank] -= 1


class map_client_errors:  # used like a function; a class builds no generator per request
    """Re-raise upstream client failures as BackendError subclasses (once, at this edge)."""

    __slots__ = ("backend",)

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        backend = self.backend
        if isinstance(exc, TimeoutError):
            raise BackendTimeout(backend, "no response in time") from exc
        if isinstance(exc, UpstreamResetError):
            raise BackendResetError(backend, str(exc)) from exc
        if isinstance(exc, UpstreamProtocolError):
            raise BackendProtocolError(backend, str(exc)) from exc
        if isinstance(exc, UpstreamLocalExhaustion):  # ours, not the backend's: no failure counted, no retry
            log.error("cannot open an upstream connection: %s", exc)
            raise GatewayOverloaded("The gateway is out of connections; try again shortly.") from exc
        if isinstance(exc, UpstreamConnectError):
            raise BackendConnectError(backend, str(exc)) from exc


def exhausted(exc: BackendError) -> GatewayError:
    """What the client gets when the last attempt failed this way."""
    if isinstance(exc, BackendOverloaded):
        return UpstreamError(exc.status, exc.error, headers=retry_after(1))
    if isinstance(exc, BackendTimeout):
        return GatewayTimeout(f"The backend did not answer in time ({exc.backend}).")
    if isinstance(exc, BackendConnectError):
        return NoHealthyBackend("No backend could be reached; try again shortly.")
    return BadGateway(f"The backend failed: {exc.detail or type(exc).__name__}")


def no_healthy_backend(
    pool: Pool, opening: str, names: Sequence[str], now: float, *, retry_after_s: int | None = None
) -> NoHealthyBackend:
    """The 503 for a request none of whose backends (`names`) takes requests: the message says why
    each one is out (an ejected one with what ejected it and its last failure); Retry-After is
    when the first ejection ends, unless given."""
    why, retry_s = pool.unavailable(names, now)
    return NoHealthyBackend(f"{opening}: {why}.", retry_after_s=retry_after_s or math.ceil(retry_s))


class Attempts:
    def __init__(
        self,
        pool: Pool,
        upstream: UpstreamPool,
        routing: RoutingState,
        recorder: Recorder,
        accounting: Accounting,
        deadlines: Deadlines,
        *,
        timeouts: Timeouts,
        max_attempts: int,
        clock: Callable[[], float],
        rng: random.Random,
        throughput: Callable[[str], float | None] | None,
    ) -> None:
        self._pool = pool
        self._upstream = upstream
        self._routing = routing
        self._recorder = recorder
        self._accounting = accounting
        self._deadlines = deadlines
        self._timeouts = timeouts
        self._max_attempts = max_attempts
        self._clock = clock
        self._rng = rng
        self._throughput = throughput

    async def open(self, route: RouteState, ex: Exchange, candidates: list[str], *, shadow: bool = False) -> Opened:
        """The first attempt that opens, or the GatewayError the client gets. `shadow` requests are
        not counted in the client-facing routing metrics. `candidates` may name discovery pools."""
        candidates = self._pool.expand(candidates)
        attempts = 0
        while True:
            state = self.decide(route, ex, candidates, count=not shadow)
            attempts += 1
            try:
                return await self._attempt(state, ex)
            except BackendError as exc:
                ex.error = exc
                if not exc.retryable or attempts >= self._max_attempts:
                    raise exhausted(exc) from exc
                if not shadow:
                    self._recorder.retry(state.name, state.runtime, type(exc).__name__)

    def decide(self, route: RouteState, ex: Exchange, candidates: list[str], *, count: bool = True) -> BackendState:
        """One routing decision among `candidates` (backend names, expanded): the chosen backend, its
        routing ticket opened on `ex`; raises the 503 (or the SLA's 429) the client gets. The
        Endpoint Picker decides here too, and Envoy sends the request (`gateway.picker`)."""
        trace = ex.trace
        if trace is not None:
            trace.routing()
        base = self._pool.snapshot(candidates, self._throughput)
        planned = ex.planned
        if planned is not None:  # a split's decode: the unit its pair was planned with (the first time)
            ex.planned = None
            only = tuple(v for v in base.backends if v.name == planned and v.healthy and v.backend not in ex.tried)
            if only:
                base = Snapshot(only)
        snapshot = self._routing.snapshot(base)
        req = RouteRequest(route.config.model, next(route.seq), frozenset(ex.tried), ex.features)
        decision = decide(route.policy, req, snapshot, self._rng)
        if decision is None:
            error = ex.error
            if error is not None:
                rest = [n for n in candidates if n not in ex.tried]
                if isinstance(error, BackendConnectError) and rest:  # the others are out: say why
                    opening = f"No backend could be reached (`{error.backend}`: {error.detail or 'no connection'})"
                    raise no_healthy_backend(self._pool, opening, rest, self._clock(), retry_after_s=1)
                raise exhausted(error)
            raise no_healthy_backend(self._pool, f"No healthy backend for model `{route.config.model}`", candidates,
                                     self._clock())
        if count:
            self._recorder.decision(route.config.model, route.policy.name, decision.reason)
        if trace is not None:
            trace.routed(route.policy.name, candidates, decision, arm=ex.arm, ab_excluded=ex.ab_excluded,
                         sla=ex.features.sla)
        if decision.reject:
            retry_after = max(1, math.ceil(decision.retry_after_s or 1.0))
            raise SlaUnattainable(
                "No backend is predicted to meet the requested latency target (x-sla-strict).",
                retry_after_s=retry_after,
            )
        ex.decision = decision
        view = next(v for v in snapshot.backends if v.name == decision.backend)  # a backend, or one rank of one
        ex.tried.add(view.backend)
        pair = ex.pair  # a P/D decode leg: its prefill ran elsewhere
        ex.ticket = self._routing.dispatched(view, ex.features, remote=pair.remote if pair is not None else None)
        ex.rank = view.rank
        ex.last = self._pool[view.backend]
        return ex.last

    async def _attempt(self, state: BackendState, ex: Exchange) -> Opened:
        parsed = ex.parsed
        assert parsed is not None
        stream = parsed.request.stream
        ex.upstream_id = new_request_id()  # the engine's request id is ours: never the client's
        ex.engine_worked = False
        resp: UpstreamResponse | None = None
        rank = ex.rank
        state.in_flight += 1
        if rank is not None:
            state.rank_in_flight[rank] += 1
        ex.sent_at = self._clock()
        adapter: Adapter = ResponsesBridge(state.adapter) if state.name in ex.bridged else state.adapter
        try:
            try:
                upstream = adapter.build_request(parsed.request, model=state.config.model,
                                                 request_id=ex.upstream_id)
            except TranslationError as untranslatable:
                raise InvalidRequest(str(untranslatable)) from untranslatable
            pin = state.pin
            if rank is not None and pin is not None:
                upstream = pinned(upstream, pin, rank)
            trace = ex.trace  # (traceparent: the engine's spans join the trace, as children of this attempt)
            headers = upstream.headers if trace is None else trace.attempt(state, upstream.headers, ex.upstream_id)
            deadline = self._deadlines.after(self._timeouts.first_token_s if stream else self._timeouts.total_s)
            with map_client_errors(state.name), deadline:
                resp = await self._upstream.request(state.base_url, "POST", upstream.path, headers, upstream.body)
                ex.engine_worked = resp.status < 400
                if resp.status >= 400:
                    self._upstream_error(state, resp.status, await resp.read(), ex)
                first = await resp.readany() if stream else await resp.read()
        except BaseException as failure:  # incl. cancellation: every dispatched ticket is closed once
            if ex.trace is not None:
                ex.trace.attempt_failed(failure)
            if resp is not None:
                resp.close()
            state.in_flight -= 1
            if rank is not None:
                state.rank_in_flight[rank] -= 1
            reached = not isinstance(failure, BackendConnectError | BackendOverloaded | GatewayError)
            ex.engine_worked = ex.engine_worked or (reached and not isinstance(failure, BackendConnectError))
            assert ex.ticket is not None
            self._routing.failed(ex.ticket, reached_engine=reached)
            ex.ticket = None
            if isinstance(failure, BackendError):
                log.info("request %s (upstream %s) failed on %s: %s", ex.request_id, ex.upstream_id, state.name,
                         failure.detail or type(failure).__name__)
                if failure.blames_backend:
                    self._accounting.judge(self._pool, state, ok=False, detail=failure.detail or type(failure).__name__)
            raise
        if stream and ex.ticket is not None:
            self._routing.first_token(ex.ticket, self._clock() - ex.sent_at)
        return Opened(state, resp, first, adapter, rank)

    def _upstream_error(self, state: BackendState, status: int, body: bytes, ex: Exchange) -> None:
        error = state.adapter.normalise_error(status, body)
        if status in (429, 503):
            raise BackendOverloaded(state.name, status, error)
        if status >= 500:
            self._accounting.judge(self._pool, state, ok=False, detail=f"status {status}")
        headers = {"x-gateway-backend": state.name, "x-gateway-runtime": state.runtime}
        if ex.ticket is not None:
            headers["x-gateway-expected-cached-tokens"] = str(ex.ticket.expected_tokens)
        raise UpstreamError(status, error, headers=headers)
