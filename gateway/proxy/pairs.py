"""A disaggregated route's requests: plan the pair, run the prefill leg, hand the decode leg on.

`Pairs.prepare` runs before the request's ordinary attempts (`attempts.Attempts.open`): it plans
the pair (`routing.disaggregation.plan`, pure), and when the request is split, runs leg 1 on the
prefill (vLLM: `backends.disaggregation`), then rewrites the request the attempts send to the decode
and returns their candidates: the planned decode unit first (`Exchange.planned`: the rank the pair
was planned with, not one the route's policy picks again), then, for vLLM and trtllm, whose handoff
any decode can take, the rest of the decode pool, for a decode that refuses the leg before doing
any work (429/503, no connection: the attempts' retry rule); SGLang's room binds its one decode.
The decode leg is the client's request: it is the one attempt that answers, is counted once by
accounting (its usage is the request's), and is never run twice. A request kept whole goes to the
decode pool as usual.

The prefill leg's rules:

- its failure is judged against the prefill's backend alone (never its decode partner); a 4xx is
  not the backend's doing, and neither is a 429/503 refusal;
- a failed leg (any failure: its answer is never shown to anyone, so running it again costs only
  compute) is retried on another prefill server, up to `retries.max_attempts` legs; with none left
  the decode serves the request alone (it computes its own prefill; the pair's outcome says so);
- an answer without usable `kv_transfer_params` where the route's `handoff` is `params` is a failed
  handoff (counted, the leg's outcome `no_params`); the decode gets the client's body as is;
- SGLang's prefill runs beside its decode, which waits for the KV (up to SGLang's waiting timeout,
  300 s by default): when the prefill fails first, the decode leg is abandoned (it computed
  nothing) and the pair is tried again with another prefill in a new room; with none left, the
  request is served whole by the route's `both` servers (a decode-mode SGLang server refuses a
  request without a room), else the client gets a 502 at once (`Pairs.decode`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, Final

from backends.base import ClientRequest, Endpoint, Runtime
from backends.disaggregation import (
    Handoff,
    sglang_bodies,
    sglang_room,
    trtllm_context_body,
    trtllm_generation_body,
    trtllm_handoff,
    vllm_decode_body,
    vllm_handoff,
    vllm_prefill_body,
)
from backends.ranks import pinned

from ..client import UpstreamPool, UpstreamResponse
from ..errors import BackendError, BackendOverloaded, BackendProtocolError, BadGateway, GatewayError
from ..observability.pd import PairRecord, PdMetrics
from ..pd_settings import DECODE_ROLES, Disaggregation, bootstrap_port
from ..rank_settings import unit_backend
from ..routing import BackendView, Decision, RouteRequest, RoutingState
from ..routing.disaggregation import PairPlan, plan, prefill_again
from ..settings import Timeouts
from ..state.pool import Pool
from .accounting import Accounting
from .attempts import Opened, map_client_errors, no_healthy_backend
from .deadlines import Deadlines
from .exchange import Exchange, new_request_id
from .request import ParsedRequest, with_body
from .routes import RouteState

log = logging.getLogger(__name__)

SPLITTABLE: Final = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
WHOLE_ONLY: Final = "whole"  # the planning role of an SGLang `both` (null-mode) server: neither leg
PROTOCOLS: Final = frozenset({Runtime.VLLM, Runtime.SGLANG, Runtime.TRTLLM})


class Refused(BackendError):
    """Leg 1 answered 4xx: the request's doing, not the backend's; the decode will say the same to
    the client, so it is sent there at once (no other prefill is tried)."""

    blames_backend = False


class Pairs:
    def __init__(self, pool: Pool, upstream: UpstreamPool, routing: RoutingState, accounting: Accounting,
                 deadlines: Deadlines, metrics: PdMetrics | None, *, timeouts: Timeouts, max_attempts: int,
                 clock: Callable[[], float], rng: random.Random) -> None:
        self._pool = pool
        self._upstream = upstream
        self._routing = routing
        self._accounting = accounting
        self._deadlines = deadlines
        self._metrics = metrics
        self._timeouts = timeouts
        self._max_attempts = max_attempts
        self._clock = clock
        self._rng = rng

    def applies(self, route: RouteState, ex: Exchange) -> Disaggregation | None:
        """The request's P/D spec: its A/B arm's, else its route's; None when it is served whole."""
        spec = route.config.disaggregation
        split = route.config.split
        if split is not None and ex.arm is not None:
            arm = next((a for a in split.arms if a.name == ex.arm), None)
            if arm is not None and arm.disaggregation is not None:
                spec = arm.disaggregation
        if spec is None or ex.endpoint not in SPLITTABLE or ex.bridged:
            return None
        return spec

    async def prepare(self, route: RouteState, ex: Exchange, spec: Disaggregation,
                      candidates: list[str]) -> list[str] | Opened:
        """The candidates of the request's answering attempt (the decode leg), after its prefill leg
        when it is split; or the answer itself, when trtllm's context leg already finished it. A
        failed prefill falls back to the decode; the one error of its own is the 503 of an SGLang
        route whose decode servers are left without any prefill (they cannot serve a request whole)."""
        pool = self._pool
        names = pool.expand(candidates)
        roles: dict[str, str] = {n: pool[n].config.role for n in names}
        if names and pool[names[0]].runtime == Runtime.SGLANG.value:  # (one runtime per disaggregated route)
            # SGLang's modes are exclusive: a decode-mode server refuses a request without a room,
            # a null-mode one (`both`) ignores the room: it serves requests whole and never pairs
            whole_pool = [n for n in names if roles[n] == "both"]
            roles = {n: WHOLE_ONLY if r == "both" else r for n, r in roles.items()}
        else:
            whole_pool = [n for n in names if roles[n] in DECODE_ROLES]
        snapshot = self._routing.snapshot(pool.snapshot(names))
        req = RouteRequest(route.config.model, next(route.seq), frozenset(), ex.features)
        chosen = plan(req, snapshot, roles, spec, self._rng)
        decode_pool = [n for n in names if roles[n] in DECODE_ROLES]
        if chosen is None:
            return whole_pool or decode_pool  # no healthy decode: the attempts say why
        decode_backend = next(v.backend for v in snapshot.backends if v.name == chosen.decode.backend)
        runtime = Runtime(pool[decode_backend].runtime)
        split = chosen.split and runtime in PROTOCOLS
        if self._metrics is not None:
            reason = chosen.reason if runtime in PROTOCOLS else "unsupported_runtime"
            self._metrics.decision(route.config.model, "split" if split else "whole", reason)
        ex.topology = "split" if split else "whole"
        if not split:
            if not whole_pool:  # SGLang decode servers alone (`when: always`), and no prefill could pair
                raise no_healthy_backend(pool, f"No prefill server of `{route.config.model}` can take the "
                                         "prefill leg (SGLang decode servers refuse a request without one)",
                                         [n for n in names if roles[n] == "prefill"], self._clock(), retry_after_s=1)
            return whole_pool
        record = ex.pair = PairRecord(chosen.reason)
        parsed = ex.parsed
        assert parsed is not None
        request = parsed.request
        if runtime is Runtime.SGLANG:  # both legs at once: the prefill's runs beside the attempts
            assert chosen.prefill is not None
            body = self._sglang(route, ex, request.body, chosen.prefill, record)
            record.again = self._sglang_again(route, ex, parsed, chosen, roles, whole_pool, decode_backend)
        else:
            params = await self._prefill(route, ex, spec, chosen, roles, decode_backend, record, runtime)
            if isinstance(params, Opened):
                return params
            body = vllm_decode_body(request.body, params) if runtime is Runtime.VLLM else \
                trtllm_generation_body(request.body, params)
        ex.parsed = with_body(parsed, body)
        ex.planned = chosen.decode.backend  # the decode unit of the plan (a rank of a wide server, or the server)
        if runtime is Runtime.SGLANG:  # the room is this decode's rendezvous with the running prefill
            return [decode_backend]
        # vLLM's and trtllm's handoff is the prefill's, not the decode's: a decode that refuses the
        # leg (429/503, no connection: it did no work) may be replaced by another of the pool
        return [decode_backend, *(n for n in decode_pool if n not in (decode_backend, record.prefill))]

    def _sglang(self, route: RouteState, ex: Exchange, client: dict[str, Any], prefill: Decision,
                record: PairRecord) -> dict[str, Any]:
        """Start the prefill leg of the client's body on `prefill`, in a new room (drained in a task,
        `settle` ends it); the decode leg's body."""
        unit = prefill.backend
        view = next(v for v in self._pool.snapshot([unit_backend(unit)]).backends if v.name == unit)
        config = self._pool[view.backend].config
        wide = config.data_parallel_size > 1
        room = sglang_room(self._rng.getrandbits(63), view.rank if wide else None, config.data_parallel_size)
        leg, decode = sglang_bodies(client, host=config.url.host or "", port=bootstrap_port(config),
                                    room=room, prefill_rank=view.rank if wide else None)
        record.task = asyncio.ensure_future(self._drain(route.config.model, ex, view, leg, record))
        return decode

    def _sglang_again(self, route: RouteState, ex: Exchange, client: ParsedRequest, chosen: PairPlan,
                      roles: dict[str, str], whole: list[str], decode_backend: str) -> Callable[[], list[str]]:
        """What `decode` does when an SGLang prefill failed: the pair again with another prefill in
        a new room, up to `retries.max_attempts` prefills (the same decode: its abandoned leg did
        nothing); then the request whole on the route's `both` servers (a decode-mode SGLang server
        refuses a request without a room); with none, the client's 502."""
        assert chosen.prefill is not None
        tried = {unit_backend(chosen.prefill.backend)}
        model = route.config.model

        def again() -> list[str]:
            record = ex.pair
            assert record is not None
            ex.tried.discard(decode_backend)
            if len(tried) < self._max_attempts:
                names = self._pool.expand(route.config.candidates)
                snapshot = self._routing.snapshot(self._pool.snapshot(names))
                req = RouteRequest(model, next(route.seq), frozenset(tried), ex.features)
                decision = prefill_again(req, snapshot, roles, decode_backend, self._rng)
                if decision is not None:
                    tried.add(unit_backend(decision.backend))
                    record.handoff, ex.planned = "ok", chosen.decode.backend
                    ex.parsed = with_body(client, self._sglang(route, ex, client.request.body, decision, record))
                    return [decode_backend]
            record.task = record.again = None
            ex.parsed = client
            if not whole:
                raise BadGateway(f"The prefill leg failed on {', '.join(sorted(tried))} and no server of the route "
                                 f"`{model}` serves a request without one (SGLang decode servers need a prefill).")
            return whole

        return again

    async def _drain(self, model: str, ex: Exchange, view: BackendView, body: dict[str, Any],
                     record: PairRecord) -> None:
        started = self._clock()
        try:
            await self._leg(ex, view, body)  # drained: only the decode's answer reaches the client
        except (BackendError, GatewayError) as failure:
            record.handoff = "prefill_failed"
            if self._metrics is not None:
                self._metrics.leg(model, "prefill", view.backend, type(failure).__name__)
            return
        ended = self._clock()
        record.prefill, record.prefill_s, record.prefill_ended_at = view.backend, ended - started, ended
        if self._metrics is not None:
            self._metrics.leg(model, "prefill", view.backend, "ok", ended - started)

    async def decode(self, ex: Exchange, open_leg: Callable[[list[str]], Awaitable[Opened]],
                     candidates: list[str]) -> Opened:
        """The decode leg's attempt (`open_leg(candidates)`). SGLang's runs beside its prefill: when
        the prefill fails before the decode has answered, the decode waits for a KV that never comes
        (SGLang's waiting timeout: 300 s by default). It is abandoned then (the connection closed:
        SGLang aborts a request whose client left; without the KV it had computed nothing) and the
        pair is tried again (`_sglang_again`): another prefill, else the request whole, where the
        pair's outcome is `prefill_failed` as for a vLLM or trtllm pair left without a prefill."""
        record = ex.pair
        while record is not None and record.task is not None and record.again is not None:
            leg = asyncio.ensure_future(open_leg(candidates))
            either: list[asyncio.Future[Any]] = [leg, record.task]
            try:
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # the client left: the leg goes with it
                leg.cancel()
                raise
            if leg.done() or record.handoff != "prefill_failed":
                return await leg
            leg.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await leg  # (cancelled: its attempt closed the connection and released its ticket)
            log.info("request %s: the SGLang prefill failed; its decode leg is abandoned", ex.request_id)
            candidates = record.again()
        return await open_leg(candidates)

    async def around(self, ex: Exchange, answering: Awaitable[None]) -> None:
        """`answering` (the decode leg and the client's response), then `settle`, however it ended.
        Here, not in the compiled `service` module: mypyc mishandles an `await` in a `finally`."""
        try:
            await answering
        finally:
            await self.settle(ex)

    async def settle(self, ex: Exchange) -> None:
        """The request is answered: a prefill leg still running (SGLang's) may finish (it normally
        has: the decode needed its KV), up to the first-token timeout when the decode served, else
        it is cancelled; then its figures are in `ex.pair` for accounting."""
        record = ex.pair
        task = record.task if record is not None else None
        if task is None:
            return
        if not task.done() and ex.status == "200":
            await asyncio.wait([task], timeout=self._timeouts.first_token_s)
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _prefill(self, route: RouteState, ex: Exchange, spec: Disaggregation, chosen: PairPlan,
                       roles: dict[str, str], decode_backend: str, record: PairRecord,
                       runtime: Runtime) -> dict[str, Any] | Opened | None:
        """Leg 1 until one answers (then its params, None when it had none), or None with
        `record.handoff = "prefill_failed"` when none did."""
        decision: Decision | None = chosen.prefill
        tried: set[str] = set()
        model = route.config.model
        while decision is not None:
            unit = decision.backend
            view = next(v for v in self._pool.snapshot([unit_backend(unit)]).backends if v.name == unit)
            tried.add(view.backend)
            started = self._clock()
            try:
                assert ex.parsed is not None
                client = ex.parsed.request.body
                leg = vllm_prefill_body(client) if runtime is Runtime.VLLM else trtllm_context_body(client)
                answer, resp = await self._leg(ex, view, leg)
            except (BackendError, GatewayError) as failure:
                kind = type(failure).__name__
                log.info("request %s: prefill leg on %s failed: %s", ex.request_id, view.backend, kind)
                if self._metrics is not None:
                    self._metrics.leg(model, "prefill", view.backend, kind)
                if isinstance(failure, Refused | GatewayError) or len(tried) >= self._max_attempts:
                    break
                names = self._pool.expand(route.config.candidates)
                snapshot = self._routing.snapshot(self._pool.snapshot(names))
                req = RouteRequest(model, next(route.seq), frozenset(tried), ex.features)
                decision = prefill_again(req, snapshot, roles, decode_backend, self._rng)
                continue
            ended = self._clock()
            record.prefill, record.prefill_s, record.prefill_ended_at = view.backend, ended - started, ended
            handoff: Handoff
            if runtime is Runtime.VLLM:
                handoff, params = vllm_handoff(answer)
            else:
                handoff, params, finished = trtllm_handoff(answer)
                if finished and not ex.parsed.request.stream:  # the context leg's answer is the whole answer
                    record.handoff = "finished"
                    if self._metrics is not None:
                        self._metrics.leg(model, "prefill", view.backend, "finished", ended - started)
                    return self._answered(ex, view, resp, answer)
            usable = handoff == "ok" or (spec.handoff == "storage" and handoff == "null")
            if self._metrics is not None:
                self._metrics.leg(model, "prefill", view.backend, "ok" if usable else "no_params", ended - started)
            if not usable:
                record.handoff = "failed"
                log.info("request %s: prefill on %s handed no usable kv_transfer_params (%s)", ex.request_id,
                         view.backend, handoff)
            return params
        record.handoff = "prefill_failed"
        return None

    def _answered(self, ex: Exchange, view: BackendView, resp: UpstreamResponse, answer: bytes) -> Opened:
        """A finished context answer as the request's response, from the context server."""
        state = self._pool[view.backend]
        state.in_flight += 1  # `Opened.release` ends it, as for any response
        if view.rank is not None:
            state.rank_in_flight[view.rank] += 1
        ex.last, ex.rank, ex.engine_worked = state, view.rank, True
        ex.tried.add(view.backend)
        return Opened(state, resp, answer, state.adapter, view.rank)

    async def _leg(self, ex: Exchange, view: BackendView, leg_body: dict[str, Any]) -> tuple[bytes, UpstreamResponse]:
        """Send leg 1 to the unit `view` and read its whole answer; BackendError when it failed."""
        state = self._pool[view.backend]
        rank = view.rank
        parsed = ex.parsed
        assert parsed is not None
        request = parsed.request
        leg_request = ClientRequest(request.endpoint, leg_body, False, False, request.created)
        upstream_id = new_request_id()
        upstream = state.adapter.build_request(leg_request, model=state.config.model, request_id=upstream_id)
        pin = state.pin
        if rank is not None and pin is not None:
            upstream = pinned(upstream, pin, rank)
        trace = ex.trace
        leg = trace.leg("prefill", state, upstream.headers, upstream_id) if trace is not None else None
        headers = upstream.headers if leg is None else leg.headers
        ticket = self._routing.dispatched(view, ex.features)
        sent_at = self._clock()
        state.in_flight += 1
        if rank is not None:
            state.rank_in_flight[rank] += 1
        resp: UpstreamResponse | None = None
        reached = False
        try:
            with map_client_errors(state.name), self._deadlines.after(self._timeouts.first_token_s):
                resp = await self._upstream.request(state.base_url, "POST", upstream.path, headers, upstream.body)
                reached = True
                body = await resp.read()
            status = resp.status
            if status in (429, 503):
                raise BackendOverloaded(state.name, status, state.adapter.normalise_error(status, body))
            if status >= 500:
                raise BackendProtocolError(state.name, f"status {status}")
            if status >= 400:
                raise Refused(state.name, f"status {status}")
        except BaseException as failure:
            if leg is not None:
                leg.end(failure)
            self._routing.failed(ticket, reached_engine=reached)
            if isinstance(failure, BackendError) and failure.blames_backend:
                self._accounting.judge(self._pool, state, ok=False, detail=failure.detail or type(failure).__name__)
            raise
        finally:
            if resp is not None:
                resp.close()
            state.in_flight -= 1
            if rank is not None:
                state.rank_in_flight[rank] -= 1
        if leg is not None:
            leg.end(status=status)
        # a prefill leg's answer is its first token (max_tokens 1): it teaches the prefill's rate,
        # which `when: auto` weighs against serving the request whole on the decode
        self._routing.first_token(ticket, self._clock() - sent_at)
        self._routing.completed(ticket, cached_tokens=None, prompt_tokens=None, itl_s=None)
        self._accounting.judge(self._pool, state, ok=True)
        assert resp is not None
        return body, resp
