"""`sla`: meet a request's latency targets (`x-sla-ttft-ms`, `x-sla-tpot-ms`) from live predictions.

Each candidate's TTFT and TPOT are predicted from its learned `LatencyModel` (see `latency.py`) and
the prefix index's expected hit. Among the backends predicted to meet every target we take the
longest prefix hit, then the lowest cost per output token, then the lowest load -> "sla". Backends
not learned yet are explored only when no learned one qualifies. When none can meet the target we
serve best effort on the predicted fastest -> "sla_miss", or, with `x-sla-strict: true`, return a
`reject` decision that the proxy answers with 429 and Retry-After.

`decide` applies the same SLA screen in front of any other policy, for requests that carry targets
on routes whose policy is not `sla`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from .affinity import PrefixAffinity
from .base import UNIT_TOKENS, Decision, Policy, RouteRequest, SlaTarget, Snapshot
from .latency import itl_bucket
from .scoring import Prediction, cost_rank, hits_for, pick

MAX_RETRY_AFTER_S = 60.0
HEADROOM = 0.8


@dataclass(frozen=True, slots=True)
class Screen:
    """The SLA verdict over the candidates: who meets the target, who is unknown, the fastest."""

    feasible: tuple[Prediction, ...]
    unknown: tuple[Prediction, ...]
    fastest: Prediction | None


def screen(req: RouteRequest, snapshot: Snapshot, target: SlaTarget, *, headroom: float = HEADROOM) -> Screen:
    """Predict every healthy, untried candidate against `target` (the SLA filter). A prediction
    meets a target when it is within `headroom` x the target: the feasible backend chosen is often
    the one closest to its limit (longest prefix hit first), so predictions need a safety margin.

    This runs for every candidate of every SLA request, so the prefix scorer and the latency model
    are inlined here (see `scoring.hit_tokens` and `LatencyModel.ttft_s`/`tpot_s` for the readable
    versions, which the tests check this against).
    """
    feasible: list[Prediction] = []
    unknown: list[Prediction] = []
    fastest: Prediction | None = None
    fastest_key = (math.inf, math.inf)
    features = req.features
    prompt_tokens = features.prompt_tokens
    models = snapshot.latency
    inf = math.inf
    # A missing target is an infinite one.
    want_ttft = inf if target.ttft_s is None else target.ttft_s * headroom
    want_tpot = inf if target.tpot_s is None else target.tpot_s * headroom
    need_ttft, need_tpot = target.ttft_s is not None, target.tpot_s is not None
    candidates = snapshot.healthy(req.exclude)
    for view, hit in zip(candidates, hits_for(snapshot, features, candidates), strict=True):
        model = models.get(view.name)
        ttft = tpot = None
        if model is not None:
            rate = model.prefill_tokens_per_s
            if rate is not None:  # LatencyModel.ttft_s, inlined
                ahead = model.backlog_tokens
                waiting, mean = view.waiting, model.mean_uncached_tokens
                if waiting and mean and waiting * mean > ahead:
                    ahead = waiting * mean
                uncached = prompt_tokens - hit
                ttft = model.base_ttft_s + (ahead + (uncached if uncached > 0 else 0)) / rate
            running = view.running if view.running is not None else view.in_flight
            tpot = model.itl_s[itl_bucket(running + 1)]
        p = Prediction(view, hit, ttft, tpot)
        t = inf if ttft is None else ttft
        o = inf if tpot is None else tpot
        if (ttft is not None and t > want_ttft) or (tpot is not None and o > want_tpot):
            pass  # known to miss
        elif (need_ttft and ttft is None) or (need_tpot and tpot is None):
            unknown.append(p)
        else:
            feasible.append(p)
        if fastest is None or (t, o) < fastest_key:
            fastest, fastest_key = p, (t, o)
    return Screen(tuple(feasible), tuple(unknown), fastest)


class _Known:
    """The screen's prefix answers, replayed to the inner policy (valid for this request only)."""

    __slots__ = ("_blocks",)

    def __init__(self, predictions: Sequence[Prediction]) -> None:
        self._blocks = {p.view.name: p.hit_tokens for p in predictions}

    def match(self, backend: str, chain: tuple[int, ...], stride: int) -> int:
        return self._blocks.get(backend, 0) // (stride * UNIT_TOKENS)


def miss(screen_: Screen, target: SlaTarget) -> Decision | None:
    """Best effort on the predicted fastest, or a reject decision when the request is strict.

    The fastest may still meet the bare target (it only failed the headroom): then it is served as
    "sla", never rejected.
    """
    fastest = screen_.fastest
    if fastest is None:
        return None
    ttft, tpot = fastest.ttft_s, fastest.tpot_s
    if not (
        (target.ttft_s is not None and (ttft is None or ttft > target.ttft_s))
        or (target.tpot_s is not None and (tpot is None or tpot > target.tpot_s))
    ):
        return Decision(fastest.view.name, "sla", fastest.hit_tokens, ttft)
    if not target.strict:
        return Decision(fastest.view.name, "sla_miss", fastest.hit_tokens, fastest.ttft_s)
    over = 1.0
    if fastest.ttft_s is not None and target.ttft_s is not None:
        over = fastest.ttft_s - target.ttft_s
    retry_after = min(max(math.ceil(over), 1), MAX_RETRY_AFTER_S)
    return Decision(
        fastest.view.name, "reject", fastest.hit_tokens, fastest.ttft_s, reject=True, retry_after_s=float(retry_after)
    )


def _best(predictions: Sequence[Prediction], key: int | None) -> Prediction:
    by_view = {p.view.name: p for p in predictions}
    view = pick(
        [p.view for p in predictions],
        lambda v: (-by_view[v.name].hit_tokens, *cost_rank(v), v.load_score),
        key,
    )
    return by_view[view.name]


class Sla:
    """Feasible first (longest prefix hit, then cost, then load); best effort or reject otherwise.
    Requests without targets are routed by `fallback` (prefix affinity)."""

    name = "sla"

    def __init__(self, *, fallback: Policy | None = None, headroom: float = HEADROOM) -> None:
        if not 0 < headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")
        self.fallback: Policy = fallback or PrefixAffinity()
        self.headroom = headroom

    def choose(self, req: RouteRequest, snapshot: Snapshot, rng: random.Random) -> Decision | None:
        target = req.features.sla
        if target is None:
            return self.fallback.choose(req, snapshot, rng)
        verdict = screen(req, snapshot, target, headroom=self.headroom)
        pool = verdict.feasible or verdict.unknown
        if pool:
            best = _best(pool, req.features.affinity_key)
            return Decision(best.view.name, "sla", best.hit_tokens, best.ttft_s)
        return miss(verdict, target)


def decide(
    policy: Policy, req: RouteRequest, snapshot: Snapshot, rng: random.Random, *, headroom: float = HEADROOM
) -> Decision | None:
    """The proxy's one call per attempt: `policy.choose`, behind the SLA filter when the request
    carries targets and the route's policy is not `sla` itself.

    The inner policy then chooses among the backends predicted to meet the target (or not yet
    learned, when none is known to), keeping its own reason; when none qualifies the request gets
    the `sla` policy's miss handling ("sla_miss" best effort, or a strict reject).
    """
    target = req.features.sla
    if target is None or policy.name == Sla.name:
        return policy.choose(req, snapshot, rng)
    verdict = screen(req, snapshot, target, headroom=headroom)
    pool = verdict.feasible or verdict.unknown
    if pool:
        narrowed = Snapshot(tuple(p.view for p in pool), _Known(pool), snapshot.latency)
        return policy.choose(req, narrowed, rng)
    return miss(verdict, target)
