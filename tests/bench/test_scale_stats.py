"""bench/scale_stats.py and bench/hold_streams.Counter: the arithmetic `bench scale` reports."""

from __future__ import annotations

import math

import pytest

from bench import scale_stats as s
from bench.hold_streams import Counter

LAG_PAGE = """\
# HELP gateway_event_loop_lag_seconds How late a 0.25 s timer fired on this process's event loop.
# TYPE gateway_event_loop_lag_seconds histogram
gateway_event_loop_lag_seconds_bucket{le="0.001"} 50.0
gateway_event_loop_lag_seconds_bucket{le="0.005"} 90.0
gateway_event_loop_lag_seconds_bucket{le="0.01"} 98.0
gateway_event_loop_lag_seconds_bucket{le="0.025"} 100.0
gateway_event_loop_lag_seconds_bucket{le="+Inf"} 100.0
gateway_event_loop_lag_seconds_count 100.0
gateway_event_loop_lag_seconds_sum 0.3
# HELP other_seconds x
# TYPE other_seconds histogram
other_seconds_bucket{le="1.0"} 7.0
other_seconds_bucket{le="+Inf"} 7.0
"""


def test_two_sockets_per_stream_under_the_limit_beside_what_is_open() -> None:
    assert s.max_streams(20_000, 17) == (20_000 - 17 - s.FD_MARGIN) // 2
    assert s.max_streams(40, 17) == 0


def test_memory_per_stream_is_the_slope_so_a_fixed_cost_cancels() -> None:
    before = 80 << 20
    arena = 4 << 20  # allocated once, by the first streams: inflates the plain average, not the slope
    levels = [(n, before + arena + n * 12 * 1024) for n in (2500, 5000, 10_000)]
    got = s.kib_per_stream(levels[1:], before + arena)  # measured from after the fixed cost
    assert got["slope_kib"] == pytest.approx(12.0)
    plain = s.kib_per_stream(levels, before)
    assert plain["average_kib"] == pytest.approx(12 + 4 * 1024 / 10_000)
    assert s.kib_per_stream([], before) == {"slope_kib": None, "average_kib": None}
    assert s.slope([(1.0, 2.0), (1.0, 3.0)]) is None


def test_rss_has_settled_when_the_last_samples_agree() -> None:
    assert not s.settled([100.0, 150.0, 180.0])
    assert not s.settled([100.0, 150.0, 180.0, 200.0, 201.0])
    assert s.settled([100.0, 150.0, 200.0, 200.5, 201.0, 201.0])


def test_lag_quantiles_from_bucket_deltas_interpolate_like_histogram_quantile() -> None:
    after = s.histogram(LAG_PAGE, "gateway_event_loop_lag_seconds")
    assert after == {0.001: 50.0, 0.005: 90.0, 0.01: 98.0, 0.025: 100.0, math.inf: 100.0}
    before = {0.001: 40.0, 0.005: 40.0, 0.01: 40.0, 0.025: 40.0, math.inf: 40.0}
    d = s.delta(before, after)  # 60 observations in the window: 10, 40, 8, 2 per bucket
    assert d[math.inf] == 60
    assert s.quantile(0.5, d) == pytest.approx(0.001 + 0.004 * (30 - 10) / 40)
    assert s.quantile(0.99, d) == pytest.approx(0.01 + 0.015 * (59.4 - 58) / 2)
    assert s.share_at_most(0.01, d) == pytest.approx(58 / 60)
    assert s.quantile(0.99, s.delta(after, after)) is None


def test_a_quantile_in_the_inf_bucket_is_the_largest_finite_bound() -> None:
    assert s.quantile(0.99, {0.01: 1.0, 0.025: 1.0, math.inf: 10.0}) == 0.025


def test_the_rest_of_the_machine_is_what_our_processes_did_not_use() -> None:
    assert s.others_cpu(busy_s=30.0, ours_s=10.0, wall_s=10.0) == 2.0
    assert s.others_cpu(busy_s=5.0, ours_s=10.0, wall_s=10.0) == 0.0
    assert s.ratio_of_medians([100.0, 90.0, 110.0], [190.0, 180.0, 200.0]) == pytest.approx(1.9)
    assert s.ratio_of_medians([], [1.0]) is None


def test_counter_counts_events_split_across_reads_once() -> None:
    c = Counter()
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2a\r\ndata: {\"a\":1}\n\n\r\n"
    assert c.feed(head, 1.0) == 1
    assert c.status == 200
    assert c.feed(b"10\r\nda", 2.0) == 0  # the marker straddles two reads
    assert c.feed(b"ta: {\"b\":2}\n\n\r\n", 3.0) == 1
    assert c.last_event_at == 3.0
    assert not c.done
    assert c.feed(b"e\r\ndata: [DO", 4.0) == 1
    assert c.feed(b"NE]\n\n\r\n0\r\n\r\n", 5.0) == 0
    assert c.done
    assert c.events == 3  # the head's, the split one and [DONE]
