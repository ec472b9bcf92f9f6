"""Prefill/decode pairs: which decode, which prefill, and whether to split the request at all. Pure.

`plan(req, snapshot, roles, spec, rng)` sees the route's routing units (backends, or data-parallel
ranks of them) with each backend's role, and returns a `PairPlan`:

1. The decode: over the decode pool (`decode` and `both` backends), the least loaded by decode load:
   requests in flight plus the engine's running and waiting requests, then KV-cache usage (a decode
   holds every running request's KV, so a fuller cache admits less); when it is the only server
   that could prefill and the request is split, the least loaded other decode.
2. Whether to split (`spec.when`): `always`, `never`, or `auto`: the prompt's predicted uncached
   tokens on that decode (the prompt's tokens minus its expected prefix hit there: exact where the
   engine's KV events are live) must reach `min_uncached_tokens` (llm-d's and Dynamo's rule: a
   prompt mostly cached on the decode costs less to finish there than to move), and the decode pool
   must not be saturated (every decode unit's KV cache at least `SATURATED_KV_USAGE` full: a
   transferred KV cache needs room the pool does not have, so the request is served whole), and,
   once the units' latency models know enough to say, the split must be predicted to cost less
   time than the request served whole on the decode (`predicted_cost`: its own time to first token
   plus the stall its prefill puts on every stream decoding where the prefill runs). A decode
   running streams beside a `prefill` server splits (its streams would each wait the prefill); a
   busy decode beside an idle prefill splits; equally loaded `both` servers keep long prompts
   whole, since the stall moves with the prefill and the handoff only adds to it.
3. The prefill: over the prefill pool (`prefill` and `both` backends) other than the decode's
   server, by prefix affinity with bounded load (`PrefixAffinity`: the prefill whose cache holds
   the prompt's prefix, unless it carries much more than the pool's mean load).

The decision and its reason are a metric label (`gateway_pd_decisions_total{decision, reason}`):
`always`, `never`, `uncached` (auto split), `cached` (auto kept whole: too few uncached tokens),
`decode_saturated`, `no_prefill` (no healthy prefill other than the decode), `slower` (auto kept
whole: the split was predicted to cost more time).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from ..pd_settings import DECODE_ROLES, PREFILL_ROLES, Disaggregation
from .affinity import PrefixAffinity
from .base import BackendView, Decision, RouteRequest, Snapshot
from .scoring import hits_for

SATURATED_KV_USAGE: Final = 0.9
_PREFILL_POLICY: Final = PrefixAffinity()

PairReason = Literal["always", "never", "uncached", "cached", "decode_saturated", "no_prefill", "slower"]


@dataclass(frozen=True, slots=True)
class PairPlan:
    """A request's plan: `decode` always (the unit that answers the client), `prefill` when split."""

    decode: Decision
    prefill: Decision | None
    reason: PairReason
    uncached_tokens: int  # predicted on the decode (the prompt's tokens when nothing is cached there)

    @property
    def split(self) -> bool:
        return self.prefill is not None

    @property
    def decision(self) -> str:
        """`split` or `whole`: the metric label beside `reason`."""
        return "split" if self.prefill is not None else "whole"


def decode_load(view: BackendView) -> tuple[float, float]:
    """The decode's sort key: requests it carries (ours in flight + the engine's running and waiting),
    then its KV-cache usage (unknown counts as empty)."""
    return (view.in_flight + (view.running or 0.0) + (view.waiting or 0.0), view.kv_usage or 0.0)


def saturated(views: tuple[BackendView, ...]) -> bool:
    """Every unit's KV cache is known to be at least `SATURATED_KV_USAGE` full."""
    return bool(views) and all(v.kv_usage is not None and v.kv_usage >= SATURATED_KV_USAGE for v in views)


def plan(req: RouteRequest, snapshot: Snapshot, roles: Mapping[str, str], spec: Disaggregation,
         rng: random.Random) -> PairPlan | None:
    """The pair for `req`; None when no decode unit is healthy. `roles` maps backends (servers, not
    ranks) to their role; a backend it does not name is `both`."""
    healthy = snapshot.healthy(req.exclude)
    decodes = tuple(v for v in healthy if roles.get(v.backend, "both") in DECODE_ROLES)
    if not decodes:
        return None
    decode_view = min(decodes, key=decode_load)  # first in config order among equals
    when = spec.when
    uncached, decode = _decode(req, snapshot, decode_view)
    if when == "never":
        return PairPlan(decode, None, "never", uncached)
    if when == "auto":
        if uncached < spec.min_uncached_tokens:
            return PairPlan(decode, None, "cached", uncached)
        if saturated(decodes):
            return PairPlan(decode, None, "decode_saturated", uncached)
    servers = {v.backend for v in healthy if roles.get(v.backend, "both") in PREFILL_ROLES}
    if servers == {decode_view.backend}:  # a `both` decode would leave no prefill: pair another decode
        others = tuple(v for v in decodes if v.backend != decode_view.backend)
        if others:
            decode_view = min(others, key=decode_load)
            uncached, decode = _decode(req, snapshot, decode_view)
    prefills = tuple(v for v in healthy
                     if roles.get(v.backend, "both") in PREFILL_ROLES and v.backend != decode_view.backend)
    chosen = _PREFILL_POLICY.choose(req, Snapshot(prefills, snapshot.prefix, snapshot.latency), rng) \
        if prefills else None
    if chosen is None:
        return PairPlan(decode, None, "no_prefill", uncached)
    if when == "auto":
        prefill_view = next(v for v in prefills if v.name == chosen.backend)
        whole, split = predicted_cost(req, snapshot, roles, decode_view, uncached, prefill_view, chosen)
        if whole is not None and split is not None and split >= whole:
            return PairPlan(decode, None, "slower", uncached)
    return PairPlan(decode, chosen, "always" if when == "always" else "uncached", uncached)


def predicted_cost(req: RouteRequest, snapshot: Snapshot, roles: Mapping[str, str], decode: BackendView,
                   uncached: int, prefill: BackendView, chosen: Decision) -> tuple[float | None, float | None]:
    """The time the request costs served whole on `decode`, and split (prefilled on `prefill`, then
    handed to `decode`), from the units' learned latency models (`latency.py`); None where a model
    does not know yet. Each cost is the request's own time to first token plus the stall its prefill
    puts on the streams decoding where it runs: a chunked-prefill engine runs the prompt in the same
    steps as its running requests, so each of them waits the prefill's time once (the inter-token
    spike P/D exists to avoid). A `prefill` server decodes nothing, so a split onto one stalls no
    stream; a `both` prefill stalls its own.

    Whole: the decode's queue and its own prefill of the uncached tokens, plus that prefill's time
    for every request it runs. Split: the prefill's queue and prefill of what is uncached there, then
    the decode's handoff (the transfer, its queue, its first step) as learned from earlier split
    requests, or, before one was seen, the decode's queue alone (optimistic: the transfer is free),
    plus, on a `both` prefill, the prefill's time for every request it runs."""
    at_decode = snapshot.latency.get(decode.name)
    at_prefill = snapshot.latency.get(prefill.name)
    if at_decode is None or at_prefill is None or at_decode.prefill_tokens_per_s is None \
            or at_prefill.prefill_tokens_per_s is None:
        return None, None
    whole = at_decode.ttft_s(uncached, decode.waiting)
    here = max(0, req.features.prompt_tokens - chosen.expected_hit_tokens)
    prefilled = at_prefill.ttft_s(here, prefill.waiting)
    handoff = at_decode.handoff_s if at_decode.handoff_s is not None else at_decode.ttft_s(0, decode.waiting)
    if whole is None or prefilled is None or handoff is None:
        return None, None
    whole += running(decode) * uncached / at_decode.prefill_tokens_per_s
    split = prefilled + handoff
    if roles.get(prefill.backend, "both") != "prefill":
        split += running(prefill) * here / at_prefill.prefill_tokens_per_s
    return whole, split


def running(view: BackendView) -> float:
    """Requests the unit is running: the engine's count, or ours in flight where that is higher (the
    engine's is scraped, so it lags)."""
    return max(view.running or 0.0, float(view.in_flight))


def _decode(req: RouteRequest, snapshot: Snapshot, view: BackendView) -> tuple[int, Decision]:
    hit = hits_for(snapshot, req.features, (view,))[0]
    return max(0, req.features.prompt_tokens - hit), Decision(view.name, "pd_decode", expected_hit_tokens=hit)


def prefill_again(req: RouteRequest, snapshot: Snapshot, roles: Mapping[str, str], decode_backend: str,
                  rng: random.Random) -> Decision | None:
    """Another prefill for a request whose prefill leg failed (`req.exclude` names the tried ones),
    never the decode's own server; None when there is none left."""
    prefills = tuple(v for v in snapshot.healthy(req.exclude)
                     if roles.get(v.backend, "both") in PREFILL_ROLES and v.backend != decode_backend)
    if not prefills:
        return None
    return _PREFILL_POLICY.choose(req, Snapshot(prefills, snapshot.prefix, snapshot.latency), rng)
