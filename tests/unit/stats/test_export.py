"""Windows merged from several processes read exactly like one process that saw all the traffic."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from gateway.settings import parse_settings
from gateway.stats.book import StatsBook
from gateway.stats.compare import Comparer
from gateway.stats.export import KEEP_S, close, expired, export_book, merge
from gateway.stats.figures import figures
from gateway.stats.peak import PEAK_LAG_S

from .fixtures import outcome, settings


def traffic(seed: int, start: float, stop: float) -> list[Any]:
    """A mixed load over [start, stop): four backends, an A/B split, streams with gaps, errors."""
    rng = random.Random(seed)
    out = []
    t = start
    while t < stop:
        backend = rng.choice(["v1", "v2", "s1", "t1"])
        arm = {"v1": "vllm", "s1": "sglang"}.get(backend) if rng.random() < 0.5 else None
        out.append(outcome(
            backend, t, completion=rng.randint(1, 200), prompt=rng.randint(1, 300), cached=rng.randint(0, 20),
            ttft=rng.uniform(0.01, 0.5), gaps=[rng.uniform(0.005, 0.05) for _ in range(rng.randint(0, 5))],
            duration=rng.uniform(0.1, 3.0), status="200" if rng.random() > 0.1 else "500",
            model="ab" if arm else "plain", arm=arm, sla=rng.choice([None, "met", "missed"]),
            generation=rng.choice([None, rng.uniform(0.1, 30.0)]),
        ))
        t += rng.uniform(0.05, 0.4)
    return out


def fed(outcomes: list[Any], started_at: float = 0.0) -> StatsBook:
    book = StatsBook(settings(), started_at=started_at)
    for o in outcomes:
        book.record(o)
    return book


def roundtrip(book: StatsBook, now: float, **kwargs: Any) -> dict[str, Any]:
    exported: dict[str, Any] = orjson.loads(orjson.dumps(export_book(book, now, **kwargs)))  # it is JSON
    return exported


@pytest.mark.parametrize("window", [60, 300, 3600])
def test_two_workers_merged_equal_one_process_that_saw_everything(window: int) -> None:
    everything = traffic(1, 0.0, 900.0)
    odd, even = everything[1::2], everything[0::2]  # the kernel spread the connections over two workers
    now = 900.0
    whole = fed(everything)
    merged = merge([roundtrip(fed(odd), now), roundtrip(fed(even), now)], now=now)
    assert merged.sources == 2
    for name in ("v1", "v2", "s1", "t1"):
        a = figures(whole, whole.backends[name], now, window)
        b = figures(merged, merged.backends[name], now, window)
        for key in ("requests", "errors", "prompt_tokens", "output_tokens", "cached_tokens", "span_s", "sla"):
            assert a[key] == b[key], (name, key)
        assert b["output_tokens_per_s"] == pytest.approx(a["output_tokens_per_s"])
        assert b["cost"]["usd_per_million_output_tokens"] == pytest.approx(a["cost"]["usd_per_million_output_tokens"])
        if window == 60:  # few samples per 1-s bucket: nobody overflowed a cap, so percentiles are exact
            assert b["ttft_s"] == a["ttft_s"]
            assert b["itl_s"] == a["itl_s"]
    assert set(merged.arms) == set(whole.arms)
    assert figures(merged, merged.total, now, window)["requests"] == figures(
        whole, whole.total, now, window)["requests"]


def test_the_comparison_document_of_a_merge_matches_the_whole() -> None:
    everything = traffic(2, 0.0, 400.0)
    now = 400.0
    whole = Comparer(fed(everything)).document(now, 300)
    parts = [roundtrip(fed(everything[i::3]), now) for i in range(3)]
    merged = Comparer(merge(parts, now=now)).document(now, 300)
    assert merged["total"]["requests"] == whole["total"]["requests"]
    assert [r["name"] for r in merged["runtimes"]] == [r["name"] for r in whole["runtimes"]]
    assert [r["requests"] for r in merged["arms"]] == [r["requests"] for r in whole["arms"]]
    assert merged["history"]["runtimes"]["vllm"]["output_tokens_per_s"] == pytest.approx(
        whole["history"]["runtimes"]["vllm"]["output_tokens_per_s"])
    assert [a["srm"]["observed"] for a in merged["ab"]] == [a["srm"]["observed"] for a in whole["ab"]]


def test_best_throughput_is_scored_on_the_sum_of_the_workers() -> None:
    """Two workers each generating 100 tokens/s are a gateway generating 200: the p90 of summed
    spans, not either worker's figure."""
    steady = [outcome("v1", i + 0.75, completion=100, generation=0.5) for i in range(600)]
    now = 600.0 + PEAK_LAG_S
    a, b = fed(steady), fed(steady, started_at=3.0)  # started 3 s apart: spans still line up
    for book in (a, b):
        book.advance(now)
    assert a.peak_output_tps("v1") == pytest.approx(100.0)
    merged = merge([roundtrip(a, now), roundtrip(b, now)], now=now)
    assert merged.backends["v1"].series.peak_output_tps == pytest.approx(200.0)


def test_thinning_keeps_the_counts_and_the_weights() -> None:
    burst = [outcome("v1", 10.5, ttft=0.001 * i) for i in range(1000)]  # one second, far past the cap
    now = 12.0
    exported = roundtrip(fed(burst), now, max_samples=8)
    bucket = next(row for g in exported["groups"] if g["name"] == "v1" for row in g["fine"] if row[0] == 10)
    assert bucket[9][0] == 1000  # seen stays 1,000 ...
    assert len(bucket[9][1]) == 8  # ... and 8 samples travel
    book = merge([exported], now=now)
    f = figures(book, book.backends["v1"], now, 60)
    assert f["requests"] == 1000
    assert f["ttft_s"]["n"] == 1000
    assert f["ttft_s"]["p50"] == sorted(bucket[9][1])[3]  # one source: its 8 samples, each standing for 125


def test_an_export_of_another_version_is_ignored() -> None:
    good = roundtrip(fed(traffic(3, 0.0, 50.0)), 50.0)
    merged = merge([{**good, "version": 999}, good], now=50.0)
    assert merged.sources == 1


def test_a_dead_workers_closed_export_keeps_its_share_of_every_window_and_of_the_best_throughput() -> None:
    """Worker b served until 600 s and died; its last export (at 600.5) stays in the merge, closed:
    every window and the best-throughput spans read as one process that saw both workers' traffic."""
    a_traffic = [outcome("v1", i + 0.75, completion=100, generation=0.5) for i in range(900)]
    b_traffic = [outcome("v1", i + 0.25, completion=100, generation=0.2) for i in range(600)]
    now = 900.0 + PEAK_LAG_S
    a, b, whole = fed(a_traffic), fed(b_traffic), fed(sorted(a_traffic + b_traffic, key=lambda o: o.finished_at))
    for book in (a, whole):
        book.advance(now)
    b.advance(600.5)
    kept = close(roundtrip(b, 600.5))
    assert kept["closed"]
    merged = merge([kept, roundtrip(a, now)], now=now)
    for window in (60, 300, 3600):
        one = figures(whole, whole.backends["v1"], now, window)
        two = figures(merged, merged.backends["v1"], now, window)
        assert (two["requests"], two["output_tokens"]) == (one["requests"], one["output_tokens"]), window
    assert figures(merged, merged.total, now, 3600)["requests"] == 1500
    spans, whole_spans = merged.backends["v1"].series.peak.state()[1], whole.backends["v1"].series.peak.state()[1]
    assert [e for e, _ in spans] == [e for e, _ in whole_spans]
    assert [tps for _, tps in spans] == pytest.approx([tps for _, tps in whole_spans])
    assert merged.backends["v1"].series.peak_output_tps == pytest.approx(200.0)


def test_rows_an_older_export_holds_do_not_take_the_slots_of_current_ones() -> None:
    """An export taken 2 s before the merge (a replica's, a retired worker's) holds 1-s rows that the
    merge's windows no longer cover; they must not land in the ring slots of the newest seconds."""
    everything = traffic(4, 0.0, 400.0)
    fresh, older = everything[0::2], [o for o in everything[1::2] if o.finished_at < 398.0]
    now = 400.0
    whole = fed(sorted(fresh + older, key=lambda o: o.finished_at))
    merged = merge([roundtrip(fed(fresh), now), roundtrip(fed(older), 398.0)], now=now)
    for window in (60, 300):
        one, two = figures(whole, whole.total, now, window), figures(merged, merged.total, now, window)
        assert (two["requests"], two["prompt_tokens"]) == (one["requests"], one["prompt_tokens"]), window


def test_a_closed_export_counts_only_in_groups_a_serving_export_has() -> None:
    """A backend the config no longer has (a worker retired before the reload that removed it) does
    not come back in the comparison with the retired worker's windows."""
    config = settings().model_dump(mode="json", exclude_none=True)
    config["backends"].append({**config["backends"][0], "name": "gone"})
    config["routes"][0]["backends"].append("gone")
    before = StatsBook(parse_settings(config), started_at=0.0)
    before.record(outcome("gone", 10.5))
    before.record(outcome("v1", 11.5))
    kept = close(roundtrip(before, 20.0))
    merged = merge([kept, roundtrip(fed([outcome("v1", 12.5)]), 20.0)], now=20.0)
    assert set(merged.backends) == {"v1", "v2", "s1", "t1"}
    assert figures(merged, merged.backends["v1"], 20.0, 60)["requests"] == 2
    alone = merge([kept], now=20.0)  # with nothing serving, all of it
    assert figures(alone, alone.backends["gone"], 20.0, 60)["requests"] == 1


def test_an_export_ages_out_once_no_window_covers_it() -> None:
    exported = roundtrip(fed(traffic(5, 0.0, 30.0)), 30.0)
    assert not expired(exported, 30.0 + KEEP_S)
    assert expired(exported, 30.0 + KEEP_S + 1)
    assert KEEP_S >= 3600 + 60  # the longest window, and the minute its first bucket may begin before it
