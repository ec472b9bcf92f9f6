"""`sla`: meet a request's latency targets (`x-sla-ttft-ms`, `x-sla-tpot-ms`) from live predictions.

Each candidate's TTFT and TPOT are predicted from its learned `LatencyModel` (see `latency.py`) and
the prefix index's expected hit. Among the backends predicted to meet every target we take the
longest prefix hit, then the lowest cost per output token, then the lowest load -> "sla".

Cold start: a backend is learned once its prefill rate rests on `WARM_SAMPLES` TTFT observations.
Until then SLA traffic reaches it only when no learned backend is predicted to meet the target: a
backend that never answered gets one request at a time (a probe: the next goes elsewhere until its
first token is back), and while every cold backend is being probed the one with the best
provisional prediction is used. A backend that turns out slow or queued so costs a request, not a
burst. Requests without targets are routed by the inner policy and warm every backend up. When none
can meet the target we serve best effort on the predicted fastest -> "sla_miss", or, with
`x-sla-strict: true`, return a `reject` decision that the proxy answers with 429 and Retry-After.

`decide` applies the same SLA screen in front of any other policy, for requests that carry targets
on routes whose policy is not `sla`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Final

from backends.values import value

from .affinity import PrefixAffinity
from .base import (
    UNIT_TOKENS,
    BackendView,
    Decision,
    Policy,
    PrefixLookup,
    RequestFeatures,
    RouteRequest,
    SlaTarget,
    Snapshot,
)
from .scoring import Prediction, argmin, cost_rank, hits_for, predict

MAX_RETRY_AFTER_S: Final = 60.0
HEADROOM: Final = 0.8
# TTFT observations before a backend's prediction may qualify it for SLA traffic. One sample says
# little (it may have been taken before a queue built up), and a cold backend's first answers come
# back within a second or so under load, so a few samples cost little exploration.
WARM_SAMPLES: Final = 3


@value
class Screen:
    """The SLA verdict over the candidates: who meets the target, who is unknown, the fastest."""

    feasible: tuple[Prediction, ...]  # learned, and predicted to meet the target
    unknown: tuple[Prediction, ...]  # cold (not learned enough to qualify) and not predicted to miss
    fastest: Prediction | None
    probes: tuple[Prediction, ...] = ()  # unknown, never answered us, none of our requests pending
    pending: tuple[int, ...] = ()  # per unknown one: our requests still waiting for a first token there

    @property
    def pool(self) -> tuple[Prediction, ...]:
        """Where a request with targets may go: the learned backends predicted to meet them; else the
        cold backends that never answered and have nothing of ours pending (one probe at a time
        teaches a backend without piling SLA traffic onto it); else the one cold backend with the
        best provisional prediction (fewest of ours pending on a tie). Empty: a predicted miss."""
        if self.feasible or self.probes or not self.unknown:
            return self.feasible or self.probes
        inf = math.inf
        keys = [(inf if p.ttft_s is None else p.ttft_s, n) for p, n in zip(self.unknown, self.pending, strict=True)]
        return (self.unknown[keys.index(min(keys))],)


def screen(
    req: RouteRequest,
    snapshot: Snapshot,
    target: SlaTarget,
    *,
    headroom: float = HEADROOM,
    warm_samples: int = WARM_SAMPLES,
) -> Screen:
    """Predict every healthy, untried candidate against `target` (the SLA filter). A prediction
    meets a target when it is within `headroom` x the target: the feasible backend chosen is often
    the one closest to its limit (longest prefix hit first), so predictions need a safety margin.

    Cold start: a backend whose prefill rate was learned from fewer than `warm_samples` TTFT
    observations is cold. Its prediction may rule it out (predicted to miss) but never qualifies it
    (it is "unknown"), so SLA traffic is not used to explore while a learned backend is predicted to
    meet the target; requests without targets explore freely.

    The predictions are `scoring.predict` (`LatencyModel.ttft_s` and `tpot_s`): the one formula,
    which `/admin/backends` shows too.
    """
    feasible: list[Prediction] = []
    unknown: list[Prediction] = []
    probes: list[Prediction] = []
    pending: list[int] = []
    fastest: Prediction | None = None
    features = req.features
    models = snapshot.latency
    inf = math.inf
    # A missing target is an infinite one.
    want_ttft = inf if target.ttft_s is None else target.ttft_s * headroom
    want_tpot = inf if target.tpot_s is None else target.tpot_s * headroom
    need_ttft, need_tpot = target.ttft_s is not None, target.tpot_s is not None
    candidates = snapshot.healthy(req.exclude)
    ft = fo = inf
    for view, hit in zip(candidates, hits_for(snapshot, features, candidates), strict=True):
        p = predict(snapshot, features, view, hit)
        model = models.get(view.name)
        cold = model is None or model.ttft_samples < warm_samples
        waits = model.pending if model is not None else 0
        ttft, tpot = p.ttft_s, p.tpot_s
        t = inf if ttft is None else ttft
        o = inf if tpot is None else tpot
        if (ttft is not None and t > want_ttft) or (tpot is not None and o > want_tpot):
            pass  # known to miss
        elif (need_ttft and (ttft is None or cold)) or (need_tpot and tpot is None):
            unknown.append(p)
            pending.append(waits)
            if ttft is None and not waits:
                probes.append(p)
        else:
            feasible.append(p)
        if fastest is None or t < ft or (t == ft and o < fo):
            fastest, ft, fo = p, t, o
    return Screen(tuple(feasible), tuple(unknown), fastest, tuple(probes), tuple(pending))


class _Known:
    """The screen's prefix answers, replayed to the inner policy (valid for this request only)."""

    __slots__ = ("_hits", "_inner", "_views")

    def __init__(self, views: tuple[BackendView, ...], hits: list[int], inner: PrefixLookup) -> None:
        self._views = views
        self._hits = hits
        self._inner = inner

    def held(self, backend: str) -> int:
        return self._inner.held(backend)

    def placed(self, key: int, views: Sequence[BackendView]) -> int:
        return self._inner.placed(key, views)

    def match(self, backend: str, chain: tuple[int, ...], stride: int) -> int:
        for view, hit in zip(self._views, self._hits, strict=True):
            if view.name == backend:
                return hit // (stride * UNIT_TOKENS)
        return 0

    def hits(self, features: RequestFeatures, views: Sequence[BackendView]) -> list[int]:
        if views is self._views:  # the narrowed snapshot's own candidates: the common case
            return list(self._hits)
        by_name = {v.name: h for v, h in zip(self._views, self._hits, strict=True)}
        return [by_name.get(v.name, 0) for v in views]


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


def _best(predictions: Sequence[Prediction], key: int | None, *, cold: bool = False) -> Prediction:
    """Longest prefix hit, then cost band, then load; ties to the rendezvous winner (`scoring.argmin`).
    Among cold backends load comes first: what they cost is not known yet, and an engine-reported
    queue is the one warning a cold backend gives."""
    ranks: list[tuple[float, ...]] = []
    for p in predictions:
        v = p.view
        load = v.in_flight + (v.waiting or 0.0)
        ranks.append((load, -p.hit_tokens, *cost_rank(v)) if cold else (-p.hit_tokens, *cost_rank(v), load))
    return predictions[argmin(ranks, key, lambda i: predictions[i].view.name)]


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
        pool = verdict.pool
        if pool:
            best = _best(pool, req.features.affinity_key, cold=not verdict.feasible)
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
    if target is None or isinstance(policy, Sla):
        return policy.choose(req, snapshot, rng)
    verdict = screen(req, snapshot, target, headroom=headroom)
    pool = verdict.pool
    if pool:
        views = tuple([p.view for p in pool])
        narrowed = Snapshot(views, _Known(views, [p.hit_tokens for p in pool], snapshot.prefix), snapshot.latency)
        return policy.choose(req, narrowed, rng)
    return miss(verdict, target)
