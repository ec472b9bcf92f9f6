from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing import assign_arm, choose_arm, rank_arms, should_shadow
from gateway.settings import Arm

RNG = random.Random(11)
WEIGHTS = {"vllm": 0.5, "sglang": 0.3, "trtllm": 0.2}
SESSIONS = [f"session-{n}" for n in range(2000)]


def test_assignment_is_deterministic_and_sticky() -> None:
    first = [assign_arm(s, WEIGHTS, salt="m", rng=random.Random(1)) for s in SESSIONS]
    again = [assign_arm(s, dict(reversed(WEIGHTS.items())), salt="m", rng=random.Random(2)) for s in SESSIONS]
    assert first == again  # 100% sticky, independent of the RNG and of the arms' order


def test_salt_decorrelates_routes() -> None:
    a = [assign_arm(s, WEIGHTS, salt="model-a", rng=RNG) for s in SESSIONS]
    b = [assign_arm(s, WEIGHTS, salt="model-b", rng=RNG) for s in SESSIONS]
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 0.5 * len(SESSIONS)


@pytest.mark.parametrize("weights", [WEIGHTS, {"a": 1, "b": 1}, {"a": 0.9, "b": 0.1}, {"a": 3, "b": 0, "c": 1}])
def test_shares_are_within_three_standard_errors_of_the_weights(weights: dict[str, float]) -> None:
    counts = Counter(assign_arm(s, weights, salt="m", rng=RNG) for s in SESSIONS)
    total = sum(weights.values())
    n = len(SESSIONS)
    for arm, w in weights.items():
        p = w / total
        se = math.sqrt(p * (1 - p) / n)
        assert abs(counts[arm] / n - p) <= 3 * se + 1e-12, (arm, counts)


def test_without_a_key_the_draw_is_random_but_weighted() -> None:
    rng = random.Random(5)
    counts = Counter(assign_arm(None, WEIGHTS, salt="m", rng=rng) for _ in range(4000))
    assert abs(counts["vllm"] / 4000 - 0.5) < 3 * math.sqrt(0.25 / 4000)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.sampled_from("abcdef"), st.floats(0.05, 10), min_size=2, max_size=6),
    st.floats(0.0, 10),
    st.data(),
)
def test_a_weight_change_moves_sessions_only_into_or_out_of_that_arm(
    weights: dict[str, float], new_weight: float, data: st.DataObject
) -> None:
    arm = data.draw(st.sampled_from(sorted(weights)))
    changed = weights | {arm: new_weight}
    if not any(w > 0 for w in changed.values()):
        return
    for s in SESSIONS[:300]:
        before = assign_arm(s, weights, salt="m", rng=RNG)
        after = assign_arm(s, changed, salt="m", rng=RNG)
        if before != after:
            assert arm in (before, after)
            assert after == arm if new_weight > weights[arm] else before == arm


def arms(*spec: tuple[str, float, list[str]]) -> list[Arm]:
    return [Arm(name=n, weight=w, backends=b) for n, w, b in spec]


def test_failover_goes_to_the_sessions_next_arm_and_says_so() -> None:
    split = arms(("a", 1, ["a1", "a2"]), ("b", 1, ["b1"]), ("c", 0, ["c1"]))
    choice = choose_arm("s1", split, salt="m", healthy={"a1", "a2", "b1"}, rng=RNG)
    assert choice is not None
    assert not choice.failed_over
    preferred = choice.arm
    other = {"a": "b", "b": "a"}[preferred]
    healthy = {"a1", "a2", "b1", "c1"} - {b for a in split if a.name == preferred for b in a.backends}
    moved = choose_arm("s1", split, salt="m", healthy=healthy, rng=RNG)
    assert moved is not None
    assert (moved.arm, moved.preferred, moved.failed_over) == (other, preferred, True)
    last = choose_arm("s1", split, salt="m", healthy={"c1"}, rng=RNG)
    assert last is not None
    assert last.arm == "c"
    assert last.failed_over
    assert choose_arm("s1", split, salt="m", healthy=set(), rng=RNG) is None


def test_rank_arms_lists_every_arm_once() -> None:
    order = rank_arms("s", {"a": 1, "b": 0, "c": 2}, salt="m", rng=RNG)
    assert sorted(order) == ["a", "b", "c"]
    assert order[-1] == "b"


def test_assign_arm_needs_a_positive_weight() -> None:
    with pytest.raises(ValueError, match="positive"):
        assign_arm("s", {"a": 0}, salt="m", rng=RNG)


def test_shadow_sampling() -> None:
    picked = [should_shadow(f"req-{n}", 0.1, RNG) for n in range(5000)]
    assert abs(sum(picked) / 5000 - 0.1) < 3 * math.sqrt(0.09 / 5000)
    assert picked == [should_shadow(f"req-{n}", 0.1, random.Random(0)) for n in range(5000)]
    assert not should_shadow("r", 0.0, RNG)
    assert should_shadow("r", 1.0, RNG)
    rng = random.Random(2)
    assert 300 < sum(should_shadow(None, 0.1, rng) for _ in range(5000)) < 700
