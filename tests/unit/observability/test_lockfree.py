"""The lock-free histogram's bucket search (gateway/observability/lockfree.py) against `bisect`."""

from __future__ import annotations

from bisect import bisect_left

from hypothesis import given
from hypothesis import strategies as st

from gateway.observability.lockfree import FastHistogram, bucket_of

FINITE = st.floats(allow_nan=False, min_value=-1e9, max_value=1e9)


@given(st.lists(FINITE, max_size=24, unique=True).map(lambda b: tuple(sorted(b))), FINITE)
def test_the_bucket_is_bisect_lefts(bounds: tuple[float, ...], value: float) -> None:
    assert bucket_of(bounds, value) == bisect_left(bounds, value)
    for bound in bounds:  # a value on a bound falls in that bound's bucket (`le` is inclusive)
        assert bucket_of(bounds, bound) == bisect_left(bounds, bound)


def test_observations_land_in_the_cumulative_buckets_prometheus_expects() -> None:
    family = FastHistogram("h", "doc", ["k"], [0.1, 1.0, 10.0, float("inf")])
    child = family.labels("v")
    for value in (0.05, 0.1, 0.5, 20.0):
        child.observe(value)
    child.observe_counted([(1.0, 3), (5.0, 2)], total=13.0)
    (metric,) = family.collect()
    buckets = {s.labels["le"]: s.value for s in metric.samples if s.name == "h_bucket"}
    assert buckets == {"0.1": 2.0, "1.0": 6.0, "10.0": 8.0, "+Inf": 9.0}
    assert child.sum == 0.05 + 0.1 + 0.5 + 20.0 + 13.0
