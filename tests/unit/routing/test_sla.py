from __future__ import annotations

import math

import pytest

from gateway.routing import (
    POLICIES,
    LatencyEstimator,
    LatencyModel,
    RoutingState,
    Sla,
    Snapshot,
    decide,
)
from gateway.routing.latency import ITL_BUCKETS, itl_bucket
from gateway.routing.scoring import hit_tokens, predict
from gateway.routing.sla import screen

from .helpers import RNG, doc, features, req, snap, view, warm

SLA = Sla()


def learned(state: RoutingState, name: str, *, tokens_per_s: float, itl_s: float = 0.02) -> None:
    for _ in range(3):
        state.observe(name, work_tokens=100 * tokens_per_s, ttft_s=100.0, running=4, itl_s=itl_s)


def test_estimator_learns_prefill_rate_base_latency_and_itl_per_batch() -> None:
    est = LatencyEstimator(alpha=0.5)
    assert est.model.ttft_s(1000) is None
    assert est.model.tpot_s(3) is None
    est.observe_ttft(work_tokens=10, ttft_s=0.05)  # short work: fixed overhead
    for _ in range(20):
        est.observe_ttft(work_tokens=2000, ttft_s=0.05 + 2000 / 4000)
    model = est.model
    assert model.base_ttft_s == pytest.approx(0.05)
    assert model.prefill_tokens_per_s == pytest.approx(4000)
    assert model.ttft_s(4000) == pytest.approx(1.05)
    est.observe_itl(running=3, itl_s=0.02)
    est.observe_itl(running=40, itl_s=0.05)
    assert est.model.tpot_s(2) == 0.02
    assert est.model.tpot_s(33) == 0.05
    assert est.model.tpot_s(12) == 0.05  # unseen bucket: the nearest, larger batch on a tie


def test_backlog_and_engine_queue_delay_the_prediction() -> None:
    est = LatencyEstimator()
    est.observe_ttft(work_tokens=1000, ttft_s=1.0)
    assert est.dispatched(500) == 0.0
    assert est.dispatched(500) == 500.0
    assert est.model.ttft_s(1000) == pytest.approx(2.0)
    assert est.model.ttft_s(1000, waiting=10) == pytest.approx(6.0)  # 10 queued x 500 mean
    est.prefilled(500)
    est.prefilled(500)
    assert est.model.ttft_s(1000) == pytest.approx(1.0)


def test_itl_buckets_are_powers_of_two() -> None:
    assert [itl_bucket(r) for r in (0, 1, 2, 3, 4, 7, 8, 1000)] == [0, 0, 1, 1, 2, 2, 3, ITL_BUCKETS - 1]


def test_feasible_backends_win_by_prefix_hit_then_cost() -> None:
    state = RoutingState()
    views = [view("slow"), view("fast", usd_per_hour=10, tps=100), view("cheap", usd_per_hour=1, tps=100)]
    learned(state, "slow", tokens_per_s=200)
    learned(state, "fast", tokens_per_s=10_000)
    learned(state, "cheap", tokens_per_s=10_000)
    f = features(doc(1, 4000), x_sla_ttft_ms="500")
    choice = SLA.choose(req(f), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("cheap", "sla")
    warm(state, views[1], f)  # now "fast" holds the prefix: longest hit beats cost
    state.observe("fast", work_tokens=10_000, ttft_s=1.0)
    choice = SLA.choose(req(f), snap(state, *views), RNG)
    assert choice is not None
    assert choice.backend == "fast"
    assert choice.expected_hit_tokens > 0


def test_none_feasible_serves_best_effort_on_the_fastest_or_rejects_when_strict() -> None:
    state = RoutingState()
    learned(state, "a", tokens_per_s=100)
    learned(state, "b", tokens_per_s=400)
    views = (view("a"), view("b"))
    loose = features(doc(1, 4000), x_sla_ttft_ms="100")
    choice = SLA.choose(req(loose), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason, choice.reject) == ("b", "sla_miss", False)
    strict = features(doc(1, 4000), x_sla_ttft_ms="100", x_sla_strict="true")
    choice = SLA.choose(req(strict), snap(state, *views), RNG)
    assert choice is not None
    assert choice.reject
    assert choice.reason == "reject"
    assert choice.predicted_ttft_s is not None
    assert choice.retry_after_s == math.ceil(choice.predicted_ttft_s - 0.1)


def test_tpot_target_uses_the_itl_at_the_current_batch() -> None:
    state = RoutingState()
    state.observe("a", running=8, itl_s=0.08)
    state.observe("b", running=8, itl_s=0.03)
    f = features("x", x_sla_tpot_ms="50")
    choice = SLA.choose(req(f), snap(state, view("a", running=7), view("b", running=7)), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("b", "sla")


def test_unknown_backends_are_explored_only_when_no_known_one_qualifies() -> None:
    state = RoutingState()
    learned(state, "known", tokens_per_s=100_000)
    f = features(doc(1), x_sla_ttft_ms="500")
    choice = SLA.choose(req(f), snap(state, view("new"), view("known", load=3)), RNG)
    assert choice is not None
    assert choice.backend == "known"
    learned(state, "known", tokens_per_s=10)
    choice = SLA.choose(req(f), snap(state, view("new"), view("known")), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("new", "sla")


def test_without_targets_sla_routes_by_prefix_affinity() -> None:
    choice = SLA.choose(req(features(doc(1))), Snapshot((view("a"), view("b"))), RNG)
    assert choice is not None
    assert choice.reason == "hash"


def test_decide_puts_the_sla_filter_in_front_of_other_policies() -> None:
    state = RoutingState()
    learned(state, "slow", tokens_per_s=50)
    learned(state, "ok", tokens_per_s=100_000)
    views = (view("slow"), view("ok", load=5))
    f = features(doc(1, 2000), x_sla_ttft_ms="300")
    for policy in ("round_robin", "least_load", "prefix_affinity", "cost"):
        for seq in range(4):
            choice = decide(POLICIES[policy], req(f, seq=seq), snap(state, *views), RNG)
            assert choice is not None
            assert choice.backend == "ok", policy
    strict = features(doc(1, 2000), x_sla_ttft_ms="1", x_sla_strict="1")
    choice = decide(POLICIES["round_robin"], req(strict), snap(state, *views), RNG)
    assert choice is not None
    assert choice.reject
    plain = decide(POLICIES["round_robin"], req(features(doc(1)), seq=0), snap(state, *views), RNG)
    assert plain is not None
    assert plain.reason == "round_robin"


def test_decide_keeps_the_inner_policys_prefix_view() -> None:
    state = RoutingState()
    learned(state, "a", tokens_per_s=100_000)
    learned(state, "b", tokens_per_s=100_000)
    f = features(doc(1, 3000), x_sla_ttft_ms="900")
    warm(state, view("b"), f)
    choice = decide(POLICIES["prefix_affinity"], req(f), snap(state, view("a"), view("b")), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("b", "affinity")


def test_screen_predicts_with_the_latency_model() -> None:
    state = RoutingState()
    learned(state, "a", tokens_per_s=3000, itl_s=0.02)
    learned(state, "b", tokens_per_s=9000, itl_s=0.04)
    f = features(doc(2, 3000), x_sla_ttft_ms="10000", x_sla_tpot_ms="1000")
    views = (view("a", block_size=64, running=3, waiting=2), view("b", block_size=16, load=2), view("c"))
    warm(state, views[0], f)
    s = snap(state, *views)
    result = screen(req(f), s, f.sla)  # type: ignore[arg-type]
    expected = {v.name: predict(s, f, v, hit_tokens(s, f, v)) for v in views}
    assert {p.view.name: p for p in result.feasible} == {k: expected[k] for k in "ab"}
    assert [p.view.name for p in result.unknown] == ["c"]


def test_latency_model_defaults_are_unknown() -> None:
    assert LatencyModel().ttft_s(100) is None
    assert LatencyModel().tpot_s(1) is None


def test_headroom_prefers_a_comfortable_backend_but_never_rejects_a_tight_fit() -> None:
    state = RoutingState()
    learned(state, "tight", tokens_per_s=1000)
    f = features(doc(1, 3600), x_sla_ttft_ms="1000", x_sla_strict="true")  # ~0.9 s predicted
    choice = SLA.choose(req(f), snap(state, view("tight")), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason, choice.reject) == ("tight", "sla", False)
    learned(state, "roomy", tokens_per_s=10_000)
    choice = SLA.choose(req(f), snap(state, view("tight"), view("roomy", usd_per_hour=100, tps=1)), RNG)
    assert choice is not None
    assert choice.backend == "roomy"


# -- cold start: learned backends first, cold ones probed one request at a time -----------------------


def test_a_cold_backend_gets_no_sla_traffic_while_a_learned_one_qualifies() -> None:
    state = RoutingState()
    learned(state, "warm", tokens_per_s=20_000)
    state.observe("cold", work_tokens=100_000, ttft_s=1.0)  # one sample, and a faster one: not trusted yet
    f = features(doc(1), x_sla_ttft_ms="800")
    for policy in (SLA, POLICIES["round_robin"], POLICIES["least_load"]):
        for seq in range(4):
            choice = decide(policy, req(f, seq=seq), snap(state, view("cold"), view("warm", load=5)), RNG)
            assert choice is not None
            assert choice.backend == "warm", policy.name
    plain = SLA.choose(req(features(doc(1))), snap(state, view("cold"), view("warm", load=5)), RNG)
    assert plain is not None
    assert plain.backend == "cold"  # requests without targets explore freely (least loaded here)


def test_a_cold_fleet_is_probed_one_request_at_a_time() -> None:
    state = RoutingState()
    views = [view(n) for n in "abcd"]
    sent = []
    for i in range(4):
        f = features(doc(10 + i), x_sla_ttft_ms="800", x_sla_strict="true")
        choice = SLA.choose(req(f), snap(state, *views), RNG)
        assert choice is not None
        assert not choice.reject  # nothing is known to miss: a strict request is served, not refused
        sent.append(choice.backend)
        state.dispatched(next(v for v in views if v.name == choice.backend), f)
    assert sorted(sent) == ["a", "b", "c", "d"]  # one probe each, none piled up while it is pending


def test_with_every_cold_backend_probed_the_best_provisional_prediction_wins() -> None:
    state = RoutingState()
    views = [view("queued"), view("quick")]
    tickets = {}
    for v in views:  # one answered probe each, and one more request pending on each
        f = features(doc(20), x_sla_ttft_ms="5000")
        state.first_token(state.dispatched(v, f), 2.0 if v.name == "queued" else 0.2)
        tickets[v.name] = state.dispatched(v, f)
    f = features(doc(21), x_sla_ttft_ms="5000")
    choice = SLA.choose(req(f), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("quick", "sla")
    screen_ = screen(req(f), snap(state, *views), f.sla)  # type: ignore[arg-type]
    assert not screen_.feasible
    assert not screen_.probes
    assert [p.view.name for p in screen_.pool] == ["quick"]


def test_a_cold_backend_predicted_to_miss_is_ruled_out() -> None:
    state = RoutingState()
    learned(state, "warm", tokens_per_s=1_000)  # learned, but too slow for the target
    state.observe("cold", work_tokens=1000, ttft_s=10.0)  # a single, very slow sample
    f = features(doc(1, 4000), x_sla_ttft_ms="500")
    result = screen(req(f), snap(state, view("warm"), view("cold"), view("new")), f.sla)  # type: ignore[arg-type]
    assert not result.feasible
    assert [p.view.name for p in result.unknown] == ["new"]
    assert [p.view.name for p in result.probes] == ["new"]


def test_warm_up_averages_the_first_samples_instead_of_trusting_the_first() -> None:
    est = LatencyEstimator(alpha=0.2)
    est.observe_ttft(work_tokens=1000, ttft_s=0.1)
    est.observe_ttft(work_tokens=1000, ttft_s=0.3)
    model = est.model
    assert model.ttft_samples == 2
    assert model.prefill_tokens_per_s == pytest.approx(1000 / 0.2)  # the mean, not 0.8 x the first
    for _ in range(50):
        est.observe_ttft(work_tokens=1000, ttft_s=0.5)
    assert est.model.prefill_tokens_per_s == pytest.approx(2000, rel=1e-3)  # then an EWMA as before
    assert est.dispatched(100) == 0.0
    assert est.model.pending == 1
    est.prefilled(100)
    assert est.model.pending == 0
