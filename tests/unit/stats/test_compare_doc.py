"""The comparison document, the Recorder hook that feeds it, the Prometheus gauges and the CLI table."""

from __future__ import annotations

import argparse
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from gateway.admin.compare_cli import render
from gateway.app import build_pool
from gateway.observability.metrics import Recorder
from gateway.stats import Comparer, LiveCollector, StatsBook

from .fixtures import outcome, settings


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def wired(clock: FakeClock, weights: Any = None) -> tuple[Recorder, StatsBook, CollectorRegistry]:
    s = settings()
    registry = CollectorRegistry()
    book = StatsBook(s, started_at=clock(), weights=weights)
    recorder = Recorder(registry, build_pool(s), clock=clock, observers=[book.record])
    registry.register(LiveCollector(book, clock))
    return recorder, book, registry


def test_the_recorder_stamps_the_clock_and_feeds_stats_and_prometheus_alike() -> None:
    clock = FakeClock(100.0)
    recorder, book, registry = wired(clock)
    for i in range(30):
        clock.now = 100.5 + i
        o = outcome("v1", 0.0, completion=60, ttft=0.25, gaps=[0.02, 0.03], duration=2.0)
        recorder.record(o)  # finished_at 0.0: stamped by the recorder
    clock.now = 130.0
    doc = Comparer(book).document(clock(), 60)
    v1 = next(b for b in doc["backends"] if b["name"] == "v1")
    assert (v1["requests"], v1["span_s"], v1["output_tokens_per_s"]) == (30, 30, 60.0)
    assert v1["itl_s"]["n"] == 60
    m = scrape(registry)
    lv = (("backend", "v1"), ("runtime", "vllm"))
    assert m[("gateway_backend_output_tokens_per_second", lv)] == 60.0
    assert m[("gateway_backend_cost_per_million_tokens_usd", lv)] == pytest.approx(96 / (3600 * 60) * 1e6)
    assert m[("gateway_requests_total", (("backend", "v1"), ("model", "plain"), ("runtime", "vllm"),
                                         ("status", "200")))] == v1["requests"]
    genai = (("backend", "v1"), ("gen_ai_request_model", "plain"), ("gen_ai_system", "vllm"))
    assert m[("gen_ai_server_time_to_first_token_seconds_count", genai)] == 30
    assert m[("gen_ai_server_time_per_output_token_seconds_sum", genai)] == pytest.approx(30 * 1.75 / 59)
    assert m[("gen_ai_client_token_usage_sum", (*genai, ("gen_ai_token_type", "output")))] == 1800
    assert ("gateway_backend_cost_per_million_tokens_usd", (("backend", "t1"), ("runtime", "trtllm"))) not in m


def test_the_document_has_every_group_the_assumptions_and_a_history() -> None:
    clock = FakeClock(0.0)
    _, book, _ = wired(clock)
    for i in range(25):
        book.record(outcome("s1", i + 0.5, model="ab", arm="sglang"))
    doc = Comparer(book).document(25.0, 300)
    assert [b["name"] for b in doc["backends"]] == ["v1", "v2", "s1", "t1"]
    assert [r["name"] for r in doc["runtimes"]] == ["vllm", "sglang", "trtllm"]
    assert [(a["route"], a["name"], a["weight"]) for a in doc["arms"]] == [("ab", "vllm", 1), ("ab", "sglang", 1)]
    assert any("usd_per_hour from config" in a for a in doc["assumptions"])
    hist = doc["history"]["backends"]["s1"]["output_tokens_per_s"]
    assert hist[-2:] == [100.0, 100.0]
    assert hist[-3] is None
    assert doc["ab"][0]["verdict"] == "not enough data yet (n=0/25, need 100 per arm)"


def test_live_weights_are_read_through_the_callable() -> None:
    live = {"vllm": 9.0, "sglang": 1.0}
    clock = FakeClock(0.0)
    _, book, _ = wired(clock, weights=lambda model: live if model == "ab" else {})
    for i in range(200):
        book.record(outcome("v1" if i % 2 else "s1", 1 + i / 100, model="ab", arm="vllm" if i % 2 else "sglang"))
    doc = Comparer(book).document(10.0, 60)
    assert doc["ab"][0]["srm"]["flagged"]  # 50/50 observed against 9:1 configured
    live.update(vllm=1.0)
    assert not Comparer(book).document(10.0, 60)["ab"][0]["srm"]["flagged"]


def test_the_cli_prints_the_same_figures() -> None:
    clock = FakeClock(0.0)
    _, book, _ = wired(clock)
    for i in range(10):
        book.record(outcome("v1", i + 0.5, completion=100, ttft=0.0123))
    doc = Comparer(book).document(10.0, 60)
    console = Console(record=True, width=80)
    render(doc, console)
    text = console.export_text()
    v1 = next(line for line in text.splitlines() if line.startswith("│v1 ")).strip("│")  # performance row
    assert v1.split("│")[2].strip() == "100"  # output tokens/s
    assert "12/12" in v1  # TTFT p50/p99, ms
    assert "$266.67" in text
    assert isinstance(argparse.Namespace, type)


def test_ab_is_cached_per_five_seconds_of_clock() -> None:
    _, book, _ = wired(FakeClock(0.0))
    c = Comparer(book)
    assert c.ab(11.0, 60) is c.ab(14.9, 60)
    assert c.ab(15.0, 60) is not c.ab(11.0, 60)


def test_random_order_of_recording_does_not_matter_for_counts() -> None:
    outs = [outcome("v2", 1 + i / 10) for i in range(50)]
    a, b = StatsBook(settings(), started_at=0.0), StatsBook(settings(), started_at=0.0)
    for o in outs:
        a.record(o)
    shuffled = outs[:]
    random.Random(0).shuffle(shuffled)
    for o in sorted(shuffled, key=lambda o: o.finished_at):
        b.record(o)
    ca, cb = Comparer(a).document(10.0, 60), Comparer(b).document(10.0, 60)
    assert ca["total"]["requests"] == cb["total"]["requests"] == 50


async def test_the_async_document_equals_the_sync_one() -> None:
    _, book, _ = wired(FakeClock(0.0))
    for i in range(300):
        book.record(outcome("v1" if i % 2 else "s1", 1 + i / 10, model="ab", arm="vllm" if i % 2 else "sglang",
                            ttft=0.1 + (i % 7) / 100))
    a = await Comparer(book).document_async(40.0, 60)
    assert a == Comparer(book).document(40.0, 60)
    assert a["ab"][0]["verdict"].startswith(("no significant difference", "vllm:", "sglang:"))
