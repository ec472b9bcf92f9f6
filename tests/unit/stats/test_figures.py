"""Known Outcomes at known clock times in, exact rates, percentiles and costs out."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.stats.figures import figures

from .fixtures import book_with, outcome


def steady_v1() -> list[Any]:
    """v1 finishes one request per second at t = 0.5 .. 9.5: 100 output, 50 prompt, 10 cached tokens."""
    return [
        outcome("v1", i + 0.5, cached=10, ttft=(i + 1) / 100, gaps=(0.02, 0.04), duration=1 + i / 10)
        for i in range(10)
    ]


def test_rates_percentiles_and_cost_are_exact() -> None:
    book = book_with(*steady_v1())
    f = figures(book, book.backends["v1"], 10.0, 60)
    assert f["span_s"] == 10
    assert (f["requests"], f["requests_per_s"]) == (10, 1.0)
    assert f["output_tokens_per_s"] == 100.0
    assert f["prompt_tokens_per_s"] == 50.0
    assert f["cached_token_share"] == 0.2
    assert f["ttft_s"] == {"p50": 0.05, "p95": 0.1, "p99": 0.1, "n": 10}
    assert f["itl_s"] == {"p50": 0.02, "p95": 0.04, "p99": 0.04, "n": 20}
    assert f["e2e_s"]["p50"] == 1.4
    assert f["cost"]["usd_per_hour"] == 96.0
    assert f["cost"]["usd_per_million_output_tokens"] == pytest.approx(96 / (3600 * 100) * 1e6, rel=1e-15)
    assert f["cost"]["best_output_tokens_per_s"] is None  # the first 10-s span is scored a minute after it ends


def test_a_runtime_sums_its_backends_prices_and_throughput() -> None:
    book = book_with(*steady_v1(), *(outcome("v2", i + 0.25, completion=50) for i in range(10)))
    f = figures(book, book.runtimes["vllm"], 10.0, 60)
    assert f["output_tokens_per_s"] == 150.0
    assert f["cost"]["usd_per_hour"] == 120.0
    assert f["cost"]["usd_per_million_output_tokens"] == pytest.approx(120 / (3600 * 150) * 1e6, rel=1e-15)


def test_a_backend_without_a_price_has_null_cost_and_so_has_its_runtime() -> None:
    book = book_with(outcome("t1", 1.5))
    for g in (book.backends["t1"], book.runtimes["trtllm"]):
        f = figures(book, g, 5.0, 60)
        assert f["output_tokens_per_s"] == 20.0
        assert f["cost"]["usd_per_million_output_tokens"] is None
        assert f["cost"]["usd_per_million_output_tokens_at_best"] is None


def test_old_traffic_leaves_the_window_but_the_best_throughput_is_remembered_for_an_hour() -> None:
    book = book_with(*steady_v1())
    f = figures(book, book.backends["v1"], 70.0, 60)
    assert (f["requests"], f["output_tokens_per_s"], f["span_s"]) == (0, 0.0, 60)
    assert f["ttft_s"]["p50"] is None
    assert f["cost"]["usd_per_million_output_tokens"] is None
    assert f["cost"]["best_output_tokens_per_s"] == 100.0
    assert f["cost"]["usd_per_million_output_tokens_at_best"] == pytest.approx(96 / 360_000 * 1e6, rel=1e-15)
    assert figures(book, book.backends["v1"], 3609.0, 60)["cost"]["best_output_tokens_per_s"] == 100.0
    assert figures(book, book.backends["v1"], 3610.0, 60)["cost"]["best_output_tokens_per_s"] is None


def test_the_current_partial_second_is_not_counted_yet() -> None:
    book = book_with(outcome("v1", 9.5))
    assert figures(book, book.backends["v1"], 9.9, 60)["requests"] == 0
    assert figures(book, book.backends["v1"], 10.0, 60)["requests"] == 1


def test_the_hour_window_joins_completed_minutes_and_the_seconds_of_this_minute() -> None:
    book = book_with(*steady_v1(), outcome("v1", 125.5, completion=300, ttft=0.5))
    f = figures(book, book.backends["v1"], 130.2, 3600)
    assert (f["requests"], f["span_s"]) == (11, 130)
    assert f["output_tokens_per_s"] == 1300 / 130
    assert f["ttft_s"]["p99"] == 0.5
    later = figures(book, book.backends["v1"], 3700.0, 3600)  # minute 0 has left; minute 2 is still in
    assert (later["requests"], later["span_s"], later["output_tokens"]) == (1, 3580, 300)


def test_errors_sla_and_client_hangups() -> None:
    book = book_with(
        outcome("s1", 1.5, status="500", ttft=None), outcome("s1", 1.5, status="stream_error"),
        outcome("s1", 1.5, status="client_closed"), outcome("s1", 1.5, sla="met"),
        outcome("s1", 2.5, sla="met"), outcome("s1", 2.5, sla="met"), outcome("s1", 2.5, sla="missed"),
        outcome("s1", 3.5),
    )
    f = figures(book, book.backends["s1"], 4.0, 60)
    assert (f["requests"], f["errors"], f["error_rate"]) == (8, 2, 0.25)
    assert f["sla"] == {"met": 3, "missed": 1, "attainment": 0.75}
    assert f["ttft_s"]["n"] == 7


def test_outcomes_are_filed_by_backend_runtime_arm_and_total() -> None:
    book = book_with(
        outcome("s1", 1.5, model="ab", arm="sglang"), outcome("v1", 1.5, model="ab", arm="vllm"),
        outcome("v1", 1.5, model="ab", arm="unknown-arm"),
        outcome("none", 1.5, status="404", completion=0, prompt=0, ttft=None),
    )
    at = 2.0
    assert figures(book, book.arms[("ab", "sglang")], at, 60)["requests"] == 1
    assert figures(book, book.arms[("ab", "vllm")], at, 60)["requests"] == 1
    assert figures(book, book.runtimes["vllm"], at, 60)["requests"] == 2
    assert figures(book, book.total, at, 60)["requests"] == 4
    assert figures(book, book.total, at, 60)["errors"] == 1


def test_memory_is_bounded_under_load() -> None:
    book = book_with(*(outcome("v1", 5 + i / 5_000, gaps=(0.01,) * 20) for i in range(5_000)))
    bucket = book.backends["v1"].series.fine.get(5)
    assert bucket is not None
    assert len(bucket.ttft.values) == bucket.ttft.cap
    assert bucket.ttft.seen == 5_000
    assert len(bucket.itl.cells) == 1  # 100,000 gaps of one value: one cell
    assert bucket.itl.count == 100_000
    f = figures(book, book.backends["v1"], 6.0, 60)
    assert f["requests"] == 5_000
    assert f["itl_s"]["p50"] == 0.01
    assert f["itl_s"]["n"] == 100_000


def test_inter_token_percentiles_count_every_gap_of_every_stream() -> None:
    """Long and short streams count by their gaps, not once each: 1,000 streams in one second, a tenth
    of them 10x slower and 10x longer; percentiles within the cells' 1% of the exact ones."""
    import random as _random

    streams = []
    rng = _random.Random(7)
    for i in range(1_000):
        slow = i % 10 == 0
        typical = 0.1 if slow else 0.01
        streams.append([rng.uniform(typical * 0.9, typical * 1.1) for _ in range(200 if slow else 20)])
    book = book_with(*(outcome("v1", 5 + i / 1_000, gaps=gaps) for i, gaps in enumerate(streams)))
    itl = figures(book, book.backends["v1"], 6.0, 60)["itl_s"]
    assert itl["n"] == 100 * 200 + 900 * 20
    exact = sorted(g for gaps in streams for g in gaps)
    for q in (0.5, 0.95, 0.99):
        want = exact[math.ceil(q * len(exact)) - 1]
        assert itl[f"p{round(q * 100)}"] == pytest.approx(want, rel=0.011)
    assert itl["p50"] is not None
    assert itl["p50"] > 0.05  # 20,000 of 38,000 gaps are slow ones (a per-stream view would say fast)
