"""The order `bench overhead` measures a round's targets in (bench/targets.py)."""

from __future__ import annotations

from bench.targets import ORDER, Target, measuring_order


def test_the_gateways_comparisons_are_measured_next_to_it_in_both_directions() -> None:
    targets = [Target(name, f"http://127.0.0.1:{i}", i) for i, name in enumerate(ORDER)]
    even, odd = ([t.name for t in measuring_order(targets, rnd)] for rnd in (0, 1))
    assert even[:3] == ["gateway", "vllm-router", "baseline"]
    assert odd == even[::-1]
    assert sorted(even) == sorted(ORDER)  # every target, once
    unknown = Target("other", "http://127.0.0.1:1", 1)
    assert measuring_order([unknown, *targets[:2]], 0)[-1] is unknown
