"""A fleet of emulated engines and one gateway, in virtual time: no processes, no sockets, no clock.

The engines are the emulator's own scheduler (`backends.emulator.engine.Engine`: continuous
batching, chunked prefill with a per-iteration token budget, FCFS admission, KV blocks, an LRU
block-hash prefix cache that evicts into the free part of the KV pool), stepped by an event queue.
The gateway side is the gateway's own routing code: `describe`, a policy's `choose` over a
`Snapshot`, and `RoutingState`'s hooks at the points the proxy calls them (dispatched, first
token, completed). What the gateway knows of the engines is what it knows in production: its own
in-flight counts at once, the engines' waiting/running gauges only as of the last load scrape
(`scrape_s`). Requests reach the engine at once (no network); TTFT is arrival to first token.

Because nothing here reads a clock, a run is a pure function of (workload, policy, fleet, seed):
the machine's noise cannot move a figure, so policies are compared on identical traffic.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from backends.base import Endpoint, Runtime
from backends.emulator import tokenizer
from backends.emulator.engine import Engine, Finished, StepResult
from backends.emulator.prefix_cache import BlockHashCache
from backends.emulator.profiles import PROFILES, EngineParams
from bench.workload import TimedRequest
from gateway.routing import BackendView, Policy, RequestFeatures, RouteRequest, RoutingState, Snapshot, describe

PROFILE = "deepseek-v3-8xh200"
INFINITE_KV = 10**9


def vllm_params(kv_tokens: int | None = None, speed: float = 1.0) -> EngineParams:
    """The profile's vLLM engine; `kv_tokens` per backend; `speed` x faster in every cost."""
    p = PROFILES[PROFILE].runtimes[Runtime.VLLM]
    if kv_tokens is not None:
        p = replace(p, kv_blocks=max(1, kv_tokens // p.block_size))
    if speed != 1.0:
        p = replace(p, t_fixed_s=p.t_fixed_s / speed, w_base_s=p.w_base_s / speed, w_moe_s=p.w_moe_s / speed,
                    kv_read_s_per_token=p.kv_read_s_per_token / speed, decode_s_per_token=p.decode_s_per_token / speed,
                    prefill_tokens_per_s=p.prefill_tokens_per_s * speed)
    return p


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request as the gateway and the engine see it, computed once for every policy."""

    req: TimedRequest
    features: RequestFeatures
    tokens: tuple[int, ...]


def prepare(requests: Sequence[TimedRequest]) -> list[Prepared]:
    out = []
    for r in requests:
        body = {"model": "m", "messages": [dict(m) for m in r.messages], "max_tokens": r.max_tokens}
        features = describe(body, Endpoint.CHAT, {k.lower(): v for k, v in r.headers.items()})
        ids = tokenizer.encode(tokenizer.render_chat([dict(m) for m in r.messages]))
        out.append(Prepared(r, features, tuple(ids)))
    return out


@dataclass(slots=True)
class Outcome:
    index: int
    backend: str
    reason: str
    arrival_s: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class _Unit:
    name: str
    engine: Engine
    busy: bool = False
    in_flight: int = 0
    waiting: float | None = None  # as of the last scrape
    running: float | None = None
    kv_usage: float | None = None
    load_area: float = 0.0  # integral of in-flight over time
    served: int = 0


@dataclass(slots=True)
class Run:
    outcomes: list[Outcome]
    duration_s: float
    load_means: dict[str, float]  # time-averaged in-flight per backend
    served: dict[str, int]
    timeline: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)  # (t, in-flight per backend)


def simulate(prepared: Sequence[Prepared], policy: Policy, params: EngineParams, *, backends: int,
             seed: int = 0, scrape_s: float = 0.5, think_s: float | None = None, timeline_s: float = 0.0,
             on_decision: Callable[[float, Snapshot, str], None] | None = None) -> Run:
    """Replay `prepared` through `policy` onto `backends` engines of `params`.

    `think_s`: closed-loop sessions (a session's next turn is sent `think_s` after its previous
    answer, or at its own arrival time if later); None: every request at its arrival time.
    """
    units = [_Unit(f"b{i}", Engine(params, BlockHashCache(params.block_size))) for i in range(backends)]
    by_name = {u.name: u for u in units}
    state = RoutingState()
    rng = random.Random(seed)
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    waiting_turn: dict[str, list[int]] = {}  # session -> queued request indexes (closed loop)
    busy_session: set[str] = set()
    for i, p in enumerate(prepared):
        s = p.req.session
        if think_s is not None and s is not None:
            waiting_turn.setdefault(s, []).append(i)
        else:
            push(p.req.at_s, "arrive", i)
    for s, idxs in waiting_turn.items():
        push(prepared[idxs[0]].req.at_s, "arrive", idxs.pop(0))
        busy_session.add(s)
    push(0.0, "scrape", None)
    if timeline_s:
        push(0.0, "sample", None)
    tickets: dict[str, Any] = {}
    meta: dict[str, tuple[int, str, str, float]] = {}  # rid -> (index, backend, reason, arrival)
    outcomes: dict[int, Outcome] = {}
    timeline: list[tuple[float, tuple[int, ...]]] = []
    remaining = len(prepared)
    last_t = 0.0
    n_seq = 0

    def start_step(u: _Unit, now: float) -> None:
        res = u.engine.step(now)
        if res is None:
            u.busy = False
            return
        u.busy = True
        push(res.end_s, "step", (u.name, res))

    while events and remaining:
        now, _, kind, payload = heapq.heappop(events)
        dt = now - last_t
        if dt > 0:
            for u in units:
                u.load_area += u.in_flight * dt
            last_t = now
        if kind == "scrape":
            for u in units:
                gauges = u.engine.snapshot()
                u.waiting, u.running, u.kv_usage = float(gauges.waiting), float(gauges.running), gauges.kv_usage
            push(now + scrape_s, "scrape", None)
        elif kind == "sample":
            timeline.append((now, tuple(u.in_flight for u in units)))
            push(now + timeline_s, "sample", None)
        elif kind == "arrive":
            p = prepared[payload]
            views = tuple(BackendView(u.name, Runtime.VLLM, True, u.in_flight, u.waiting, u.running, u.kv_usage,
                                      None, params.block_size) for u in units)
            snap = state.snapshot(Snapshot(views))
            decision = policy.choose(RouteRequest("m", n_seq, features=p.features), snap, rng)
            n_seq += 1
            assert decision is not None
            if on_decision is not None:
                on_decision(now, snap, decision.backend)
            u = by_name[decision.backend]
            view = next(v for v in views if v.name == u.name)
            rid = f"r{payload}"
            tickets[rid] = state.dispatched(view, p.features)
            meta[rid] = (payload, u.name, decision.reason, now)
            u.in_flight += 1
            u.engine.submit(rid, p.tokens, output_tokens=p.req.max_tokens, finish_reason="length", now_s=now)
            if not u.busy:
                start_step(u, now)
        elif kind == "step":
            name, res = payload
            u = by_name[name]
            _apply(res, u, state, tickets, meta, outcomes, now)
            for tok in res.tokens:
                fin = tok.finished
                if fin is None:
                    continue
                remaining -= 1
                s = prepared[meta[fin.rid][0]].req.session
                if think_s is not None and s is not None:
                    queue = waiting_turn.get(s)
                    if queue:
                        nxt = queue.pop(0)
                        push(max(prepared[nxt].req.at_s, now + think_s), "arrive", nxt)
            start_step(u, now)
    duration = last_t or 1.0
    return Run([outcomes[i] for i in sorted(outcomes)], duration, {u.name: u.load_area / duration for u in units},
               {u.name: u.served for u in units}, timeline)


def _apply(res: StepResult, u: _Unit, state: RoutingState, tickets: dict[str, Any],
           meta: dict[str, tuple[int, str, str, float]], outcomes: dict[int, Outcome], now: float) -> None:
    for tok in res.tokens:
        ticket = tickets.get(tok.rid)
        if ticket is None:
            continue
        index, backend, reason, arrival = meta[tok.rid]
        if tok.index == 0:
            state.first_token(ticket, tok.time_s - arrival)
            outcomes[index] = Outcome(index, backend, reason, arrival, tok.time_s - arrival, 0, tok.cached_tokens)
        fin: Finished | None = tok.finished
        if fin is not None:
            first = fin.first_token_s if fin.first_token_s is not None else fin.finished_s
            itl = (fin.finished_s - first) / (fin.output_tokens - 1) if fin.output_tokens > 1 else None
            state.completed(ticket, cached_tokens=fin.cached_tokens, prompt_tokens=fin.prompt_tokens, itl_s=itl)
            outcomes[index].prompt_tokens = fin.prompt_tokens
            u.in_flight -= 1
            u.served += 1
            del tickets[tok.rid]
