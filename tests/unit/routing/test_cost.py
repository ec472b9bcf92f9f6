from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing import Cost, RoutingState, Snapshot
from gateway.routing.scoring import COST_TIE, DEFAULT_LOAD_FACTOR, DEFAULT_SLACK, cost_per_output_token

from .helpers import RNG, doc, features, req, snap, view, warm

COST = Cost()


def test_cost_per_output_token_is_price_over_measured_throughput() -> None:
    assert cost_per_output_token(view("a", usd_per_hour=36.0, tps=1000)) == 36.0 / 3_600_000
    assert cost_per_output_token(view("a", usd_per_hour=36.0)) is None
    assert cost_per_output_token(view("a", tps=1000)) is None


def test_a_pricier_but_faster_backend_can_be_cheaper() -> None:
    snapshot = Snapshot((view("cheap-slow", usd_per_hour=2, tps=100), view("dear-fast", usd_per_hour=8, tps=1000)))
    choice = COST.choose(req(features(doc(1))), snapshot, RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("dear-fast", "cost")


def test_unknown_cost_ranks_after_known_and_ties_break_by_load() -> None:
    x, y = view("x", usd_per_hour=1, tps=100, load=2), view("y", usd_per_hour=1, tps=100)
    snapshot = Snapshot((view("unknown"), x, y))
    assert COST.choose(req(features(doc(1))), snapshot, RNG).backend == "y"  # type: ignore[union-attr]
    only_unknown = Snapshot((view("u1", load=1), view("u2")))
    assert COST.choose(req(features(doc(1))), only_unknown, RNG).backend == "u2"  # type: ignore[union-attr]


def test_near_equal_costs_prefer_the_prefix_holder() -> None:
    state = RoutingState()
    f = features(doc(1))
    warm(state, view("b"), f)
    views = (view("a", usd_per_hour=1.0, tps=100), view("b", usd_per_hour=1.02, tps=100))
    choice = COST.choose(req(f), snap(state, *views), RNG)
    assert choice is not None
    assert choice.backend == "b"
    assert choice.expected_hit_tokens > 0


def test_the_cheapest_fills_up_to_the_load_bound_then_the_next_takes_over() -> None:
    views = (view("cheap", usd_per_hour=1, tps=100, load=9), view("dear", usd_per_hour=5, tps=100, load=1))
    choice = COST.choose(req(features(doc(1))), Snapshot(views), RNG)
    assert choice is not None
    assert choice.backend == "dear"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 50), st.floats(10, 5000), st.integers(0, 20)), min_size=1, max_size=8))
def test_never_a_costlier_band_when_a_cheaper_acceptable_backend_exists(fleet: list[tuple[float, float, int]]) -> None:
    views = [view(f"b{i}", usd_per_hour=p, tps=t, load=n) for i, (p, t, n) in enumerate(fleet)]
    choice = COST.choose(req(features(doc(1))), Snapshot(tuple(views)), RNG)
    assert choice is not None
    bound = DEFAULT_LOAD_FACTOR * sum(n for _, _, n in fleet) / len(fleet) + DEFAULT_SLACK
    chosen = views[int(choice.backend[1:])]
    assert chosen.load_score <= bound
    best = min(cost_per_output_token(v) or 0.0 for v in views if v.load_score <= bound)
    assert (cost_per_output_token(chosen) or 0.0) <= best * math.exp(COST_TIE) ** 1.01  # within one cost band
