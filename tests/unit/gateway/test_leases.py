"""Leased rate limits, the pure part: the authority's rule and a holder's decisions (no event loop)."""

from __future__ import annotations

import heapq
import random

import pytest

from gateway.access.leases import IDLE_RETURN_S, WAIT, Ask, Authority, Grant, Lease, grant_size


def test_a_capacity_that_flips_never_refills_the_bucket() -> None:
    """Two replicas disagreeing on a key's limit (5 vs 6 a minute), settling in turn: the bucket is
    rescaled at each flip, never read as full, so the two grant about one budget between them."""
    authority = Authority()
    granted = 0
    now = 0.0
    for i in range(30):
        rpm = 5 if i % 2 == 0 else 6
        granted += authority.settle(f"replica-{i % 2}", Ask("k", rpm, 0, want=1), now).granted
        now += 0.05  # 30 asks in 1.5 s: at most 0.15 units of refill
    assert 5 <= granted <= 6


def test_a_rescaled_bucket_keeps_its_fraction() -> None:
    authority = Authority()
    assert authority.settle("a", Ask("k", 10, 0, want=8), 0.0).granted == 8  # 2 of 10 left: 20 %
    after = authority.settle("a", Ask("k", 100, 0), 0.0)  # the limit raised to 100: 20 of 100
    assert after.requests == pytest.approx(20.0)
    lowered = authority.settle("a", Ask("k", 5, 0), 0.0)
    assert lowered.requests == pytest.approx(1.0)


def test_tokens_rescale_with_their_debt() -> None:
    """An overdrawn token bucket keeps its time until full when the limit changes."""
    authority = Authority()
    assert authority.settle("a", Ask("k", 0, 600, tokens=1800), 0.0).tokens == pytest.approx(-1200)
    doubled = authority.settle("a", Ask("k", 0, 1200), 0.0).tokens
    assert doubled == pytest.approx(-2400)  # 3 minutes until full either way (-2 budgets, 1 a minute)


def test_returned_units_go_back_up_to_the_capacity() -> None:
    authority = Authority()
    assert authority.settle("a", Ask("k", 10, 0, want=10), 0.0).granted == 10
    assert authority.settle("a", Ask("k", 10, 0, returned=4), 0.0).requests == pytest.approx(4)
    assert authority.settle("a", Ask("k", 10, 0, returned=40), 0.0).requests == pytest.approx(10)


@pytest.mark.parametrize(("level", "want", "holders", "expected"), [
    (0.99, 5, 1, 0), (1.0, 5, 6, 1), (30.0, 50, 3, 10), (30.0, 4, 3, 4), (7.5, 50, 2, 4), (100.0, 0, 1, 0),
])
def test_a_grant_is_a_fair_share_of_the_whole_units(level: float, want: int, holders: int, expected: int) -> None:
    assert grant_size(level, want, holders) == expected


def test_holders_that_went_quiet_no_longer_count() -> None:
    authority = Authority()
    for name in "abc":
        authority.settle(name, Ask("k", 60, 0), 0.0)
    assert authority.settle("a", Ask("k", 60, 0), 1.0).holders == 3
    assert authority.settle("a", Ask("k", 60, 0), 10.0).holders == 1


def test_the_promises_add_up_to_at_most_what_the_bucket_has_however_old() -> None:
    """Holder a settles once; b then takes units seven times. What a's stand-in may admit on its own
    (its promise, from an answer older than all of b's) and b's, with everything granted, stay within
    the budget: shares of the level as each last saw it added up to 19 + 6 of what was 12."""
    authority = Authority()
    first = authority.settle("a", Ask("k", 20, 0, want=1), 0.0)
    granted = first.granted
    last = first
    for i in range(7):
        last = authority.settle("b", Ask("k", 20, 0, want=1), 0.01 * (i + 1))
        granted += last.granted
    assert granted == 8
    assert first.promised + last.promised + granted <= 20
    assert last.requests == pytest.approx(20 - 8 - first.promised, abs=0.1)  # what b may still be granted (+ refill)
    assert first.promised >= 1  # and each may admit some on its own
    assert last.promised >= 1


def test_a_small_budget_is_granted_whole_to_two_holders() -> None:
    """Promises are whole units: a fraction of one must not keep a 2-a-minute key's last unit."""
    authority = Authority()
    assert authority.settle("a", Ask("k", 2, 0, want=1), 0.0).granted == 1
    assert authority.settle("b", Ask("k", 2, 0, want=1), 0.0).granted == 1


def test_a_promise_is_free_again_once_its_holder_went_quiet() -> None:
    authority = Authority()
    assert authority.settle("a", Ask("k", 60, 0), 0.0).promised == 30
    assert authority.settle("b", Ask("k", 60, 0), 0.0).requests == pytest.approx(30)
    assert authority.settle("b", Ask("k", 60, 0), 10.0).requests == pytest.approx(60)


def test_a_lease_admits_from_what_it_holds_and_refuses_on_the_last_answer() -> None:
    lease = Lease()
    assert lease.decide(60, 0, 0.0) == WAIT  # nothing known yet
    lease.answered(Grant(2, 0.2, None, 1), 0.0)
    assert lease.decide(60, 0, 0.0) is None
    assert lease.decide(60, 0, 0.0) is None
    assert lease.decide(60, 0, 0.0) == (1, "requests")  # 0.8 units to go at 1 a second
    assert lease.decide(60, 0, 0.9) == WAIT  # by now the authority may have one
    assert lease.levels(60, 0, 0.0)["requests"] == pytest.approx(0.2)


def test_tokens_are_decided_on_the_last_answer_less_what_was_charged_since() -> None:
    lease = Lease()
    lease.answered(Grant(0, None, 100.0, 1), 0.0)
    assert lease.decide(0, 600, 0.0) is None
    lease.charge(150, 0.0)
    assert lease.decide(0, 600, 0.0) == (5, "tokens")  # 50 below zero at 10 a second
    ask = lease.ask("k", 0, 600, 0.0, 0.001)
    assert ask.tokens == 150
    assert lease.tokens_owed == 0


def test_a_busy_lease_asks_ahead_and_an_idle_one_gives_back() -> None:
    lease = Lease()
    lease.answered(Grant(1, 100.0, None, 1), 0.0)
    now = 0.0
    for _ in range(50):  # 50 requests a second for a second
        lease.held = max(lease.held, 1)
        lease.arrived(now)
        assert lease.decide(6000, 0, now) is None
        now += 0.02
    assert lease.target(now, 0.06) >= 5  # ~30 a second over 0.18 s
    assert lease.low(6000, now, 0.06)
    assert lease.ask("k", 6000, 0, now, 0.06).want >= 5
    lease.held = 7
    later = now + IDLE_RETURN_S + 0.1
    assert lease.due(6000, 0, later, flush_s=0.02)
    ask = lease.ask("k", 6000, 0, later, 0.06)
    assert (ask.returned, ask.want, lease.held) == (7, 0, 0)


def test_a_sparse_key_holds_nothing_between_requests() -> None:
    lease = Lease()
    lease.answered(Grant(1, 10.0, None, 1), 0.0)
    lease.arrived(0.0)
    assert lease.decide(60, 0, 0.0) is None
    assert not lease.low(60, 0.0, 0.001)
    assert lease.ask("k", 60, 0, 0.0, 0.001).want == 0


def simulate(*, holders: int, rpm: int, seconds: float, per_holder_rps: float, round_trip_s: float,
             seed: int = 7) -> tuple[int, float]:
    """Holders sharing one authority, each with Poisson arrivals, settles taking `round_trip_s` (the
    authority acts half way), waiting admissions decided again when each settle answers. Returns
    (admitted, the configured budget over the run: burst + refill)."""
    rng = random.Random(seed)
    authority = Authority()
    leases = [Lease() for _ in range(holders)]
    in_flight: list[tuple[Ask, float] | None] = [None] * holders
    waiting: list[int] = [0] * holders
    events: list[tuple[float, int, str]] = [(rng.expovariate(per_holder_rps), i, "request") for i in range(holders)]
    heapq.heapify(events)
    admitted = 0
    trip = [round_trip_s] * holders

    def send(i: int, now: float) -> None:
        lease = leases[i]
        lease.waiting = waiting[i]
        in_flight[i] = (lease.ask("k", rpm, 0, now, trip[i]), now)
        heapq.heappush(events, (now + round_trip_s, i, "answer"))

    while events:
        now, i, what = heapq.heappop(events)
        if now > seconds:
            break
        lease = leases[i]
        if what == "request":
            heapq.heappush(events, (now + rng.expovariate(per_holder_rps), i, "request"))
            lease.arrived(now)
            verdict = lease.decide(rpm, 0, now)
            if verdict is None:
                admitted += 1
                if lease.low(rpm, now, trip[i]) and in_flight[i] is None:
                    send(i, now)
            elif verdict == WAIT:
                waiting[i] += 1
                if in_flight[i] is None:
                    send(i, now)
        else:
            flight = in_flight[i]
            assert flight is not None
            ask, sent = flight
            in_flight[i] = None
            lease.answered(authority.settle(f"h{i}", ask, sent + round_trip_s / 2), now)
            still = 0
            for _ in range(waiting[i]):  # decided again: admitted, refused, or waiting for the next round
                verdict = lease.decide(rpm, 0, now)
                admitted += verdict is None
                still += verdict == WAIT
            waiting[i] = still
            if still or lease.due(rpm, 0, now, flush_s=0.02) or lease.low(rpm, now, trip[i]):
                send(i, now)
    return admitted, rpm + rpm / 60 * seconds


@pytest.mark.parametrize("round_trip_s", [0.001, 0.06, 0.15])
def test_a_saturated_fleet_is_granted_the_configured_budget_within_five_percent(round_trip_s: float) -> None:
    """Six holders (3 replicas x 2 workers) hammering one key at 120 a minute for 12 s, the store
    near, 60 ms and 150 ms away: never more than the budget, never 5 % less."""
    admitted, budget = simulate(holders=6, rpm=120, seconds=12, per_holder_rps=20, round_trip_s=round_trip_s)
    assert budget * 0.95 <= admitted <= budget + 1, (admitted, budget)


def test_a_fleet_under_its_budget_is_refused_nothing() -> None:
    """Demand well under the budget: every request admitted, most of them from held units."""
    admitted, _ = simulate(holders=6, rpm=60_000, seconds=5, per_holder_rps=50, round_trip_s=0.06)
    assert admitted >= 6 * 50 * 5 * 0.9
