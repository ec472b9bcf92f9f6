"""Throughput is attributed over each request's generation time, and "best throughput" is a decaying
p90 of completed 10-s spans, not the largest burst ever seen."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.stats.figures import figures
from gateway.stats.history import history
from gateway.stats.peak import PEAK_HORIZON_S, PEAK_LAG_S, PEAK_SPAN_S

from .fixtures import book_with, outcome


def sixty_streams_finishing_together() -> list[Any]:
    """60 streams of 60 s, 10 tokens/s each (600 tokens), all generating from 0.5 to 60.5: the fleet
    really produced 600 tokens/s for a minute."""
    return [outcome("v1", 60.5, completion=600, generation=60.0, duration=60.2) for _ in range(60)]


def test_streams_that_finish_together_are_counted_over_their_lifetime() -> None:
    book = book_with(*sixty_streams_finishing_together())
    last_10s = figures(book, book.backends["v1"], 61.0, 10)
    assert (last_10s["requests"], last_10s["output_tokens"]) == (60, 36_000)  # counts stay exact, by finish
    assert last_10s["output_tokens_per_s"] == pytest.approx(570.0)  # 9 full seconds and half of one
    minute = figures(book, book.backends["v1"], 61.0, 60)
    assert minute["output_tokens_per_s"] == pytest.approx((59 * 600 + 300) / 60)
    points = history(book, 61.0)["backends"]["v1"]["output_tokens_per_s"]
    assert points[-6:] == pytest.approx([570.0, 600.0, 600.0, 600.0, 600.0, 600.0])


def test_streams_that_finish_together_do_not_inflate_the_best_throughput() -> None:
    book = book_with(*sixty_streams_finishing_together())
    ripe = 70 + PEAK_LAG_S  # the last span touched, [60, 70), is scored a lag after it ends
    f = figures(book, book.backends["v1"], ripe, 60)
    assert f["cost"]["best_output_tokens_per_s"] == pytest.approx(600.0)  # not 3,600 (36,000 tokens in 10 s)
    assert book.peak_output_tps("v1") == pytest.approx(600.0)
    assert f["cost"]["usd_per_million_output_tokens_at_best"] == pytest.approx(96 / (3600 * 600) * 1e6)


def test_a_span_is_scored_only_after_the_lag() -> None:
    book = book_with(*(outcome("v1", i + 0.5) for i in range(10)))  # 100 tokens/s in [0, 10)
    series = book.backends["v1"].series
    series.advance(PEAK_SPAN_S + PEAK_LAG_S - 0.01)
    assert series.peak_output_tps is None
    series.advance(PEAK_SPAN_S + PEAK_LAG_S)
    assert series.peak_output_tps == 100.0


def steady(backend: str, start: int, stop: int, *, tokens_per_s: int) -> list[Any]:
    """One request a second in [start, stop), each carrying a second of output at `tokens_per_s`."""
    return [outcome(backend, i + 0.75, completion=tokens_per_s, generation=0.5) for i in range(start, stop)]


def test_one_burst_does_not_set_the_best_throughput() -> None:
    burst = outcome("v1", 300.5, completion=10_000)  # one span of 1,100 tokens/s among 60 of 100
    book = book_with(*steady("v1", 0, 300, tokens_per_s=100), burst, *steady("v1", 300, 600, tokens_per_s=100))
    book.advance(600 + PEAK_LAG_S)
    assert book.peak_output_tps("v1") == 100.0  # the maximum would say 1,100


def test_an_old_peak_ages_out() -> None:
    book = book_with(*steady("v1", 0, 600, tokens_per_s=1000))  # ten fast minutes, then a slower hour
    book.advance(600 + PEAK_LAG_S)
    assert book.peak_output_tps("v1") == 1000.0
    for o in steady("v1", 600, 1200, tokens_per_s=100):
        book.record(o)
    book.advance(1200 + PEAK_LAG_S)  # 60 fast spans and 60 slow ones: the fast are still the top tenth
    assert book.peak_output_tps("v1") == 1000.0
    for o in steady("v1", 1200, 600 + PEAK_HORIZON_S, tokens_per_s=100):
        book.record(o)
    book.advance(600 + PEAK_HORIZON_S)  # every fast span ended an hour ago or more
    assert book.peak_output_tps("v1") == 100.0


def test_an_idle_backends_best_throughput_ages_with_the_gateways_traffic() -> None:
    book = book_with(*steady("v1", 0, 600, tokens_per_s=1000))
    book.record(outcome("v2", 600 + PEAK_HORIZON_S - 0.5))
    assert book.peak_output_tps("v1") == 1000.0
    book.record(outcome("v2", 600 + PEAK_HORIZON_S + 0.5))  # v1 gets nothing, yet its figure expires
    assert book.peak_output_tps("v1") is None
    assert book.peak_output_tps("v2") is None  # not yet scored
    assert book.peak_output_tps("nonexistent") is None


def test_a_stream_longer_than_the_fine_ring_is_clipped_to_it_and_kept_whole_in_the_minutes() -> None:
    book = book_with(outcome("v1", 700.5, completion=6000, generation=600.0))  # 10 tokens/s from 100.5
    series = book.backends["v1"].series
    assert series.fine.get(400) is None  # older than the 1-s ring holds: dropped there, no slot clobbered
    assert series.output_tokens(401, 701) == pytest.approx(10 * 299.5)
    end = series.fine.get(700)
    assert end is not None
    assert end.completion_tokens == 6000
    assert end.output_tokens == pytest.approx(5.0)
    hour = figures(book, book.backends["v1"], 701.0, 3600)
    assert hour["output_tokens"] == 6000
    assert hour["output_tokens_per_s"] * hour["span_s"] == pytest.approx(6000.0)
    five_min = figures(book, book.backends["v1"], 701.0, 300)
    assert five_min["output_tokens_per_s"] == pytest.approx((10 * 299 + 5) / 300)
