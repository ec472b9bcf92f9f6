from __future__ import annotations

import random

from gateway.stats.quantiles import Reservoir, nearest_rank, percentile, summary, weighted_samples

RNG = random.Random(0)


def filled(values: list[float], cap: int = 1000) -> Reservoir:
    r = Reservoir(cap)
    for v in values:
        r.add(v, RNG)
    return r


def test_nearest_rank_is_the_textbook_definition() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert nearest_rank(xs, 0.5) == 50.0
    assert nearest_rank(xs, 0.95) == 95.0
    assert nearest_rank(xs, 0.99) == 99.0
    assert nearest_rank([7.0], 0.99) == 7.0
    assert nearest_rank([1.0, 2.0, 3.0], 0.5) == 2.0


def test_unweighted_summary_matches_sorted_samples_exactly() -> None:
    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.5, 0.8, 0.6, 1.0]
    s = summary([filled(xs[:4]), filled(xs[4:])])
    assert s == {"p50": 0.5, "p95": 1.0, "p99": 1.0, "n": 10}


def test_a_full_reservoir_stays_bounded_and_weights_its_samples() -> None:
    busy = filled([1.0] * 10_000, cap=10)
    quiet = filled([2.0] * 10, cap=10)
    assert len(busy.values) == 10
    assert busy.seen == 10_000
    assert busy.weight == 1000.0
    pairs = weighted_samples([busy, quiet])
    # 10,000 ones against 10 twos: the p99 is still 1.0 because the busy bucket weighs 1000x per sample
    assert percentile(pairs, 0.99) == 1.0
    assert percentile(pairs, 0.9995) == 2.0


def test_reservoir_keeps_a_uniform_sample() -> None:
    r = Reservoir(200)
    rng = random.Random(1)
    for i in range(20_000):
        r.add(float(i), rng)
    mean = sum(r.values) / len(r.values)
    assert 8_000 < mean < 12_000  # uniform over 0..19,999 has mean ~10,000


def test_empty_summary_is_null() -> None:
    assert summary([]) == {"p50": None, "p95": None, "p99": None, "n": 0}


def test_the_weighted_pass_agrees_with_the_pairwise_definition() -> None:
    rng = random.Random(3)
    rs = []
    for cap, n in ((5, 50), (20, 20), (8, 400), (3, 3)):
        r = Reservoir(cap)
        for _ in range(n):
            r.add(rng.random(), rng)
        rs.append(r)
    pairs = weighted_samples(rs)
    s = summary(rs, (0.1, 0.5, 0.95, 0.99))
    assert s == {"p10": percentile(pairs, 0.1), "p50": percentile(pairs, 0.5), "p95": percentile(pairs, 0.95),
                 "p99": percentile(pairs, 0.99), "n": 473}
