from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing import POLICIES, PrefixAffinity, RequestFeatures, RoutingState, Snapshot
from gateway.routing.scoring import DEFAULT_SLACK, by_rendezvous

from .helpers import RNG, doc, features, req, snap, view, warm

POLICY = PrefixAffinity()


def test_new_prefix_is_placed_by_rendezvous_and_repeats_follow_the_index() -> None:
    state = RoutingState()
    views = [view(n) for n in "abcd"]
    f = features(doc(1))
    first = POLICY.choose(req(f), snap(state, *views), RNG)
    assert first is not None
    assert first.reason == "hash"
    warm(state, views["abcd".index(first.backend)], f)
    again = POLICY.choose(req(features(doc(1), "a different question")), snap(state, *views), RNG)
    assert again is not None
    assert (again.backend, again.reason) == (first.backend, "affinity")
    assert again.expected_hit_tokens > 0


def test_longest_expected_hit_wins_over_a_shorter_one() -> None:
    state = RoutingState()
    views = [view(n) for n in "abcd"]
    base = doc(1, 4096)
    warm(state, views[0], features(base[:1024]))
    warm(state, views[2], features(base[:3072]))
    choice = POLICY.choose(req(features(base)), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("c", "affinity")


def test_equal_hits_go_to_the_less_loaded_holder() -> None:
    state = RoutingState()
    f = features(doc(1))
    for name in "ab":
        warm(state, view(name), f)
    choice = POLICY.choose(req(f), snap(state, view("a", load=3), view("b", load=2), view("c", load=2)), RNG)
    assert choice is not None
    assert choice.backend == "b"


def test_an_overloaded_holder_spills_down_the_ranking() -> None:
    """The holder is held to the same bound as every other choice (`load_factor` x the mean load +
    `slack`); above it the walk takes the first candidate under the bound. (A looser holder bound,
    2x the mean + 4, let one backend carry 1.7x the mean in-flight load on multi-turn traffic:
    bench routing-sim.)"""
    state = RoutingState()
    f = features(doc(1))
    warm(state, view("a"), f)
    busy = (view("a", load=5), view("b", load=2), view("c", load=2), view("d", load=2))  # mean 2.75: bound 5.4
    assert POLICY.load_factor * 2.75 + POLICY.slack >= 5
    kept = POLICY.choose(req(f), snap(state, *busy), RNG)
    assert kept is not None
    assert (kept.backend, kept.reason) == ("a", "affinity")
    views = (view("a", load=8), view("b", load=2), view("c", load=2), view("d", load=2))  # mean 3.5: bound 6.4
    assert POLICY.load_factor * 3.5 + POLICY.slack < 8
    choice = POLICY.choose(req(f), snap(state, *views), RNG)
    assert choice is not None
    assert choice.backend != "a"
    assert choice.reason == "spill"
    # The spill target is the rendezvous order of the rest: the same in every process.
    assert POLICY.choose(req(f), snap(RoutingState(), *views[1:]), RNG).backend == choice.backend  # type: ignore[union-attr]


def test_an_explicit_key_lands_where_it_was_last_sent_however_short_its_prompts() -> None:
    """A short prompt (no block to find again) with x-session-id goes where the key went last, even
    when its rendezvous first choice would now be free: the key is remembered, not recomputed."""
    state = RoutingState()
    views = [view(n) for n in "abcd"]
    first = features("", "hi", x_session_id="conv-1")  # the next prompt shares no block with it
    order = [v.name for v in by_rendezvous(views, first.affinity_key)]  # type: ignore[arg-type]
    warm(state, view(order[2]), first)  # placed on its third choice (say, an earlier spill)
    again = POLICY.choose(req(features("", "and then?", x_session_id="conv-1")), snap(state, *views), RNG)
    assert again is not None
    assert (again.backend, again.reason) == (order[2], "hash")
    other = POLICY.choose(req(features("", "good morning", x_session_id="conv-2")), snap(state, *views), RNG)
    assert other is not None  # another key is not pulled along: its own first choice, unless that
    # is the one backend holding something (the remembered key), above the mean of nearly nothing
    theirs = [v.name for v in by_rendezvous(views, other_key("conv-2")) if v.name != order[2]]
    assert other.backend == theirs[0]


def other_key(session: str) -> int:
    key = features("", "hi", x_session_id=session).affinity_key
    assert key is not None
    return key


def test_a_new_explicit_key_goes_to_the_backend_holding_least() -> None:
    """A cold fleet's first tenants spread instead of queueing on whichever backend their
    rendezvous order puts first; ties go in rendezvous order."""
    state = RoutingState()
    views = [view(n) for n in "abcd"]
    key = other_key("conv-new")
    order = [v.name for v in by_rendezvous(views, key)]
    for n in range(3):  # the first choice holds three documents, the others nothing
        warm(state, view(order[0]), features(doc(100 + n)))
    choice = POLICY.choose(req(features("", "hi", x_session_id="conv-new")), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == (order[1], "hash")
    # once placed it stays, though the first choice is no fuller than the rest any more
    warm(state, view(order[1]), features("", "hi", x_session_id="conv-new"))
    for name in order[1:]:
        for n in range(3):
            warm(state, view(name), features(doc(200 + 10 * ord(name[0]) + n)))
    again = POLICY.choose(req(features("", "next", x_session_id="conv-new")), snap(state, *views), RNG)
    assert again is not None
    assert again.backend == order[1]


def test_a_forgotten_backend_forgets_the_keys_placed_on_it() -> None:
    state = RoutingState()
    views = [view(n) for n in "abcd"]
    f = features("", "hi", x_prefix_key="tenant-7")
    order = [v.name for v in by_rendezvous(views, f.affinity_key)]  # type: ignore[arg-type]
    warm(state, view(order[3]), f)
    assert views[snap(state, *views).prefix.placed(f.affinity_key, views)].name == order[3]  # type: ignore[arg-type]
    state.forget(order[3])  # it restarted: its cache, and the reason to go there, are gone
    choice = POLICY.choose(req(f), snap(state, *views), RNG)
    assert choice is not None
    assert choice.backend == order[0]


def test_no_key_falls_back_to_least_load() -> None:
    short = req(RequestFeatures(prompt_tokens=3))
    choice = POLICY.choose(short, Snapshot((view("a", load=2), view("b"))), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("b", "least_load")


def test_excluded_and_unhealthy_backends_are_never_chosen() -> None:
    f = features(doc(1))
    snapshot = Snapshot((view("a", healthy=False), view("b"), view("c")))
    for n in range(30):
        choice = POLICY.choose(req(features(doc(n)), exclude=frozenset({"b"})), snapshot, RNG)
        assert choice is not None
        assert choice.backend == "c"
    assert POLICY.choose(req(f, exclude=frozenset({"b", "c"})), snapshot, RNG) is None


def test_removing_a_backend_only_moves_its_own_keys() -> None:
    full = Snapshot(tuple(view(n) for n in "abcd"))
    keys = [features(doc(n, 256)) for n in range(400)]
    before = {i: POLICY.choose(req(f), full, RNG).backend for i, f in enumerate(keys)}  # type: ignore[union-attr]
    without_b = Snapshot(tuple(v for v in full.backends if v.name != "b"))
    after = {i: POLICY.choose(req(f), without_b, RNG).backend for i, f in enumerate(keys)}  # type: ignore[union-attr]
    assert {i for i in before if before[i] != after[i]} == {i for i in before if before[i] == "b"}
    assert 60 < Counter(before.values())["b"] < 140  # and rendezvous spreads keys evenly


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=8), min_size=2, max_size=10, unique=True), st.data())
def test_rendezvous_minimal_disruption_for_any_fleet(names: list[str], data: st.DataObject) -> None:
    gone = data.draw(st.sampled_from(names))
    full = Snapshot(tuple(view(n) for n in names))
    rest = Snapshot(tuple(view(n) for n in names if n != gone))
    for n in range(50):
        f = features("", x_prefix_key=f"tenant-{n}")
        before = POLICY.choose(req(f), full, RNG)
        after = POLICY.choose(req(f), rest, RNG)
        assert before is not None
        assert after is not None
        assert (before.backend == after.backend) == (before.backend != gone)


loads = st.lists(st.integers(0, 30), min_size=2, max_size=10)


@settings(max_examples=300, deadline=None)
@given(loads, st.integers(0, 10_000), st.sampled_from([1.0, 1.25, 2.0]), st.data())
def test_bounded_load_guard_never_picks_above_the_bound(
    backend_loads: list[int], doc_id: int, factor: float, data: st.DataObject
) -> None:
    """Whoever holds the prefix, nothing is chosen above `load_factor` x the mean load + `slack`
    (consistent hashing with bounded loads); "affinity" is only ever a holder."""
    state = RoutingState()
    views = [view(f"b{i}", load=n) for i, n in enumerate(backend_loads)]
    f = features(doc(doc_id, 512))
    holders = data.draw(st.sets(st.sampled_from(range(len(views)))))
    for i in holders:
        warm(state, views[i], f)
    mean = sum(backend_loads) / len(backend_loads)
    bound = factor * mean + DEFAULT_SLACK
    policy = PrefixAffinity(load_factor=factor)
    choice = policy.choose(req(f), snap(state, *views), RNG)
    assert choice is not None
    chosen = int(choice.backend[1:])
    assert views[chosen].load_score <= bound
    if choice.reason == "affinity":
        assert chosen in holders


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32), st.lists(st.integers(0, 5), min_size=4, max_size=4))
def test_same_inputs_same_choice_in_any_process(seed: int, backend_loads: list[int]) -> None:
    """Pure: the choice depends only on (request, snapshot), not on the RNG or process state."""
    views = Snapshot(tuple(view(n, load=x) for n, x in zip("abcd", backend_loads, strict=True)))
    f = features(doc(seed % 1000, 256))
    picks = {POLICY.choose(req(f), views, random.Random(s)).backend for s in (seed, seed + 1)}  # type: ignore[union-attr]
    assert len(picks) == 1


def test_a_hot_prefix_spreads_instead_of_snowballing() -> None:
    """Simulate a hot tenant with half the traffic over 4 backends with completions lagging: the
    guard keeps every backend within the bound (`load_factor` x the mean + `slack`, one more
    dispatched after the check) and spreads the hot prefix over several."""
    state = RoutingState()
    names = "abcd"
    in_flight = dict.fromkeys(names, 0)
    queue: list[str] = []
    served: Counter[str] = Counter()
    max_ratio = 0.0
    rng = random.Random(3)
    for n in range(4000):
        hot = rng.random() < 0.5
        f = features(doc(0) if hot else doc(1 + rng.randrange(50)), f"q{n}")
        views = [view(x, load=in_flight[x]) for x in names]
        choice = POLICY.choose(req(f), snap(state, *views), rng)
        assert choice is not None
        warm(state, views[names.index(choice.backend)], f)
        in_flight[choice.backend] += 1
        queue.append(choice.backend)
        if hot:
            served[choice.backend] += 1
        if len(queue) > 24:  # ~24 requests in flight (a steady state at ~70% of 4 x 8 slots)
            in_flight[queue.pop(0)] -= 1
        mean = sum(in_flight.values()) / 4
        if n > 100:
            max_ratio = max(max_ratio, max(in_flight.values()) / mean)
    assert max_ratio <= (POLICY.load_factor * 6 + POLICY.slack + 1) / 6  # the mean is 6 (24 in flight over 4)
    assert len(served) >= 2


def test_registry_has_every_configurable_policy() -> None:
    from typing import get_args

    from gateway.settings import PolicyName

    assert set(POLICIES) == set(get_args(PolicyName))
    assert all(POLICIES[name].name == name for name in POLICIES)


def test_a_holder_stuck_behind_a_long_prefill_loses_to_one_that_can_start_sooner() -> None:
    """A holder keeps its prefix behind a queue shorter than `stickiness` (16) times what moving
    would re-prefill (~500 tokens here: ~8,500); behind a longer one, another backend starts sooner."""
    state = RoutingState()
    views = [view(n) for n in "ab"]
    session = features(doc(1, 2000), x_session_id="s")  # ~500 tokens, cached on a
    warm(state, views[0], session)
    choice = POLICY.choose(req(session), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("a", "affinity")
    # a new 6k-token document is being prefilled on a (dispatched, no first token yet): it stays
    doc_ticket = state.dispatched(views[0], features(doc(2, 24_000)))
    choice = POLICY.choose(req(session), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("a", "affinity")
    # two more: ~12,000 tokens ahead on a
    more = [state.dispatched(views[0], features(doc(n, 12_000))) for n in (3, 4)]
    choice = POLICY.choose(req(session), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("b", "spill")
    for ticket in (doc_ticket, *more):
        state.first_token(ticket, 0.4)  # those prefills are done: back to the holder
    choice = POLICY.choose(req(session), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("a", "affinity")


def test_new_prefixes_go_to_the_less_loaded_of_two_rendezvous_choices() -> None:
    """Two choices: of the two best rendezvous candidates, the one this gateway has given less."""
    from gateway.routing.scoring import by_rendezvous

    state = RoutingState()
    views = [view(n) for n in "abcd"]
    f = features(doc(50))
    assert f.affinity_key is not None
    first, second = (v.name for v in by_rendezvous(views, f.affinity_key)[:2])
    choice = POLICY.choose(req(f), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == (first, "hash")
    warm(state, views["abcd".index(first)], features(doc(51, 8000)))  # `first` holds more now
    choice = POLICY.choose(req(f), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == (second, "hash")


def test_a_short_queue_on_the_holder_does_not_move_the_prefix_to_a_cold_backend() -> None:
    """Moving costs the prefix twice (prefilled again, and evicting someone else's): a holder with
    a queue shorter than that keeps its prefix."""
    state = RoutingState()
    views = [view(n) for n in "ab"]
    session = features(doc(1, 2000), x_session_id="s")  # ~500 tokens, cached on a
    warm(state, views[0], session)
    state.dispatched(views[0], features(doc(3, 2000)))  # another ~500-token miss queued on a
    choice = POLICY.choose(req(session), snap(state, *views), RNG)
    assert choice is not None
    assert (choice.backend, choice.reason) == ("a", "affinity")
