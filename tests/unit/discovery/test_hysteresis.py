"""The hold on answers that name a subset of the endpoints (gateway/discovery/hysteresis.py): pure,
no event loop; answers come with the time they arrived."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.discovery import Endpoint
from gateway.discovery.hysteresis import LITERAL, Hold, Presence

POOL = [Endpoint(f"127.0.0.{i}", 8000) for i in range(2, 10)]
A, B, C = POOL[:3]


def answers(presence: Presence, *named: frozenset[Endpoint], start: float = 0.0, every_s: float = 1.0) -> list[
        frozenset[Endpoint]]:
    """Feed `named` one per `every_s`; the sets in force after each."""
    return [presence.answer(n, start + i * every_s).endpoints for i, n in enumerate(named)]


def test_literal_follows_every_answer() -> None:
    seen = answers(Presence(LITERAL), frozenset({A, B}), frozenset({B}), frozenset(), frozenset({C}))
    assert seen == [frozenset({A, B}), frozenset({B}), frozenset(), frozenset({C})]


def test_an_endpoint_leaves_after_both_the_answers_and_the_seconds() -> None:
    presence = Presence(Hold(answers=3, seconds=10.0))
    presence.answer(frozenset({A, B}), 0.0)
    for t in (1.0, 2.0, 3.0, 9.0):  # three answers without B are not enough before 10 s...
        held = presence.answer(frozenset({A}), t)
        assert held.endpoints == {A, B}
        assert held.missing == {B}
    assert presence.answer(frozenset({A}), 10.0).endpoints == {A}  # ...10 s after the last answer naming it

    presence = Presence(Hold(answers=3, seconds=10.0))
    presence.answer(frozenset({A, B}), 0.0)
    assert presence.answer(frozenset({A}), 60.0).endpoints == {A, B}  # 60 s of failures, then one answer
    assert presence.answer(frozenset({A}), 61.0).endpoints == {A, B}
    assert presence.answer(frozenset({A}), 62.0).endpoints == {A}  # the third answer without it


def test_an_answer_naming_it_again_starts_the_count_over() -> None:
    presence = Presence(Hold(answers=2, seconds=0.0))
    seen = answers(presence, frozenset({A, B}), frozenset({A}), frozenset({A, B}), frozenset({A}), frozenset({A}))
    assert seen == [frozenset({A, B})] * 4 + [frozenset({A})]


def test_a_restarted_source_starts_from_the_set_in_force() -> None:
    presence = Presence.of(Hold(answers=2, seconds=5.0), frozenset({A, B}), now=100.0)
    assert presence.endpoints == {A, B}
    assert presence.answer(frozenset({A}), 101.0).endpoints == {A, B}  # its first partial answer drains nothing
    assert presence.answer(frozenset({A}), 105.0).endpoints == {A}


def test_a_hold_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="answers >= 1"):
        Hold(answers=0)
    with pytest.raises(ValueError, match="seconds >= 0"):
        Hold(seconds=-1.0)


@given(st.lists(st.sets(st.sampled_from(POOL), min_size=1, max_size=4), min_size=1, max_size=40),
       st.integers(1, 6), st.floats(0.0, 30.0))
def test_what_an_answer_names_is_in_force_and_nothing_unnamed_joins(
    named: list[set[Endpoint]], count: int, seconds: float,
) -> None:
    presence = Presence(Hold(answers=count, seconds=seconds))
    ever: set[Endpoint] = set()
    for t, names in enumerate(named):
        ever |= names
        held = presence.answer(frozenset(names), float(t))
        assert names <= held.endpoints <= ever
        assert held.missing == held.endpoints - names


@given(st.integers(2, 8), st.integers(1, 4), st.integers(0, 7), st.integers(10, 60))
def test_rotating_subsets_that_name_each_endpoint_within_the_hold_drain_nothing(
    pool_size: int, per_answer: int, offset: int, rounds: int,
) -> None:
    """A server naming `per_answer` of `pool_size` records in turn (capped, rotating answers): with
    `answers` at least pool_size / per_answer rounded up, every endpoint stays once named."""
    pool = POOL[:pool_size]
    per_answer = min(per_answer, pool_size)
    gap = -(-pool_size // per_answer)  # answers between two that name the same endpoint, at most
    presence = Presence(Hold(answers=gap, seconds=0.0))
    ever: set[Endpoint] = set()
    for i in range(rounds):
        start = (offset + i * per_answer) % pool_size
        names = {pool[(start + k) % pool_size] for k in range(per_answer)}
        ever |= names
        assert presence.answer(frozenset(names), float(i)).endpoints == ever


@given(st.integers(1, 6), st.floats(0.0, 20.0), st.floats(0.1, 5.0))
def test_an_endpoint_gone_for_good_leaves_at_the_first_answer_past_both_limits(
    count: int, seconds: float, every_s: float,
) -> None:
    presence = Presence(Hold(answers=count, seconds=seconds))
    presence.answer(frozenset({A, B}), 0.0)
    i = 0
    while True:
        i += 1
        t = i * every_s
        if B not in presence.answer(frozenset({A}), t).endpoints:
            break
    assert i >= count  # not before both limits...
    assert t >= seconds
    assert i == count or (i - 1) * every_s < seconds  # ...and at the first answer past both
