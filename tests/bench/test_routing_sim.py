"""The virtual-time routing bench: a pure function of its inputs, every request served, and SMG's
cache_aware rules as its source states them."""

from __future__ import annotations

import random

from bench.multiturn_workload import MultiTurnSpec, calibrate, generate, ideal
from bench.sim_cache_aware import CacheAware
from bench.sim_fleet import prepare, simulate, vllm_params
from gateway.routing import PrefixAffinity, RouteRequest, Snapshot
from tests.unit.routing.helpers import doc, features, view


def _workload() -> list:  # type: ignore[type-arg]
    reqs = generate(MultiTurnSpec(requests=80, active_sessions=8, tenants=4))
    best = ideal(reqs, 64)
    reqs, _ = calibrate(reqs, best, load=0.7, fleet_prefill_tokens_per_s=4 * 15_000)
    return prepare(reqs)


def test_a_run_is_deterministic_and_serves_every_request() -> None:
    prepared = _workload()
    runs = [simulate(prepared, PrefixAffinity(), vllm_params(60_000), backends=4, think_s=0.05) for _ in range(2)]
    assert len(runs[0].outcomes) == len(prepared)
    assert [(o.backend, o.ttft_s, o.cached_tokens) for o in runs[0].outcomes] == \
        [(o.backend, o.ttft_s, o.cached_tokens) for o in runs[1].outcomes]
    assert all(o.ttft_s > 0 for o in runs[0].outcomes)
    assert sum(o.cached_tokens for o in runs[0].outcomes) > 0  # conversations reuse their history
    assert sum(runs[0].served.values()) == len(prepared)


def test_cache_aware_follows_the_tree_when_balanced_and_the_least_loaded_when_not() -> None:
    policy = CacheAware(balance_abs=4, balance_rel=1.5)
    f = features(doc(1, 4096))
    rng = random.Random(0)
    first = policy.choose(RouteRequest("m", 0, features=f), Snapshot((view("a"), view("b", load=1))), rng)
    assert first is not None
    assert (first.backend, first.reason) == ("a", "cache_miss")  # nothing matched: least loaded
    again = policy.choose(RouteRequest("m", 1, features=f), Snapshot((view("a", load=3), view("b"))), rng)
    assert again is not None
    assert (again.backend, again.reason) == ("a", "cache_hit")  # spread 3 <= 4: the tree decides
    spread = policy.choose(RouteRequest("m", 2, features=f), Snapshot((view("a", load=9), view("b", load=2))), rng)
    assert spread is not None
    assert (spread.backend, spread.reason) == ("b", "imbalanced")  # 9 - 2 > 4 and 9 > 1.5 x 2
