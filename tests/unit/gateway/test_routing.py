from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from backends.base import Runtime
from gateway.routing import BackendView, LeastLoad, RoundRobin, RouteRequest, Snapshot

RNG = random.Random(7)


def view(name: str, *, in_flight: int = 0, waiting: float | None = None, healthy: bool = True) -> BackendView:
    return BackendView(
        name=name,
        runtime=Runtime.VLLM,
        healthy=healthy,
        in_flight=in_flight,
        waiting=waiting,
        running=None,
        kv_usage=None,
        usd_per_hour=None,
    )


def req(seq: int, exclude: frozenset[str] = frozenset()) -> RouteRequest:
    return RouteRequest(model="m", seq=seq, exclude=exclude)


def test_round_robin_cycles_over_healthy_backends_only() -> None:
    snap = Snapshot((view("a"), view("b", healthy=False), view("c")))
    picks = [RoundRobin().choose(req(i), snap, RNG) for i in range(6)]
    assert [p.backend for p in picks if p] == ["a", "c", "a", "c", "a", "c"]


def test_policies_return_none_when_nothing_is_healthy_or_everything_was_tried() -> None:
    snap = Snapshot((view("a", healthy=False), view("b")))
    for policy in (RoundRobin(), LeastLoad()):
        assert policy.choose(req(0, frozenset({"b"})), snap, RNG) is None


def test_least_load_never_picks_the_busiest_of_two() -> None:
    snap = Snapshot((view("idle"), view("busy", in_flight=3, waiting=10)))
    assert {LeastLoad().choose(req(i), snap, random.Random(i)).backend for i in range(50)} == {"idle"}  # type: ignore[union-attr]


def test_least_load_counts_engine_queue_as_load() -> None:
    snap = Snapshot((view("a", in_flight=1, waiting=5), view("b", in_flight=2, waiting=0)))
    assert LeastLoad().choose(req(0), snap, RNG).backend == "b"  # type: ignore[union-attr]


@given(st.lists(st.integers(min_value=0, max_value=20), min_size=3, max_size=8), st.integers(0, 2**32))
def test_least_load_never_chooses_the_unique_maximum(loads: list[int], seed: int) -> None:
    snap = Snapshot(tuple(view(f"b{i}", in_flight=n) for i, n in enumerate(loads)))
    choice = LeastLoad().choose(req(0), snap, random.Random(seed))
    assert choice is not None
    top = max(loads)
    if loads.count(top) == 1:
        assert choice.backend != f"b{loads.index(top)}"


def test_least_load_spreads_evenly_over_equal_backends() -> None:
    snap = Snapshot(tuple(view(n) for n in "abcd"))
    rng = random.Random(1)
    counts = Counter(LeastLoad().choose(req(i), snap, rng).backend for i in range(4000))  # type: ignore[union-attr]
    assert all(900 < c < 1100 for c in counts.values()), counts
