"""Worker scrapes merged into one page by each family's declared rule: sums where each worker has its
share, one reading of one shared thing, one count of events every worker observes, per-worker series
where nothing else means anything; counters never go backwards, whatever comes and goes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

import gateway.observability.metrics
import gateway.observability.process
import gateway.stats.prom  # noqa: F401  (their families' rules are declared where they are defined)
from gateway.cluster.scrape import ScrapeMerger, dump
from gateway.merge_rules import Merge, declare
from gateway.observability.lockfree import FastCounter, FastHistogram

Page = dict[tuple[str, tuple[tuple[str, str], ...]], float]

declare(Merge.SUM, "test_requests", "test_ttft_seconds", "test_key_requests_total", "test_lag_seconds")
declare(Merge.ONCE, "test_answers", "test_endpoints")
declare(Merge.WORKER, "test_own_events")


class Gauges:
    def __init__(self, values: dict[str, dict[tuple[str, ...], float]], labels: tuple[str, ...] = ("backend",)) -> None:
        self.values = values
        self.labels = labels

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, series in self.values.items():
            labelled = any(len(lv) for lv in series)
            family = GaugeMetricFamily(name, name, labels=list(self.labels) if labelled else [])
            for lv, v in series.items():
                family.add_metric(list(lv), v)
            yield family


class Counters:
    """Counter families read from plain numbers (as the KV and discovery collectors read theirs)."""

    def __init__(self, values: dict[str, dict[tuple[str, ...], float]], labels: tuple[str, ...] = ("source",)) -> None:
        self.values = values
        self.labels = labels

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, series in self.values.items():
            family = CounterMetricFamily(name, name, labels=list(self.labels))
            for lv, v in series.items():
                family.add_metric(list(lv), v)
            yield family


class Worker:
    """One worker's registry: lock-free request families, prometheus_client ones, and plain numbers."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = FastCounter("test_requests", "Requests.", ("backend", "status"))
        self.ttft = FastHistogram("test_ttft_seconds", "TTFT.", ("backend",), (0.1, 1.0))
        self.registry.register(self.requests)
        self.registry.register(self.ttft)
        self.keys = Counter("test_key_requests_total", "Per key.", ("key",), registry=self.registry)
        self.lag = Histogram("test_lag_seconds", "Lag.", buckets=(0.01,), registry=self.registry)
        self.counters = Counters({})
        self.registry.register(self.counters)

    def serve(self, n: int, backend: str = "a") -> Worker:
        for i in range(n):
            self.requests.labels(backend, "200").inc()
            self.ttft.labels(backend).observe(0.05 if i % 2 else 0.5)
            self.keys.labels("team").inc()
            self.lag.observe(0.001)
        return self

    def count(self, family: str, value: float, *labels: str) -> Worker:
        self.counters.values.setdefault(family, {})[labels or ("pool",)] = value
        return self


def page(merger: ScrapeMerger) -> Page:
    body, content_type = merger.render("")
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


REQUESTS_A = ("test_requests_total", (("backend", "a"), ("status", "200")))
ANSWERS = ("test_answers_total", (("source", "pool"),))


def merged(*registries: CollectorRegistry) -> ScrapeMerger:
    """A merger that has one scrape of each registry, as workers w0, w1, ..."""
    merger = ScrapeMerger()
    for i, registry in enumerate(registries):
        merger.update(f"w{i}", dump(registry), worker=str(i))
    return merger


def gauges(values: dict[str, dict[tuple[str, ...], float]], labels: tuple[str, ...] = ("backend",),
           ) -> CollectorRegistry:
    """A worker's registry holding only these gauge families."""
    registry = CollectorRegistry()
    registry.register(Gauges(values, labels))
    return registry


def test_the_dump_carries_each_familys_declared_rule() -> None:
    rules = {row[0]: row[5] for row in dump(Worker().registry)}
    assert rules == {"test_requests": "sum", "test_ttft_seconds": "sum", "test_key_requests": "sum",
                     "test_lag_seconds": "sum"}


def test_counters_and_histograms_that_sum_are_summed_over_workers() -> None:
    got = page(merged(Worker().serve(3).registry, Worker().serve(5).registry))
    assert got[REQUESTS_A] == 8
    assert got[("test_ttft_seconds_count", (("backend", "a"),))] == 8
    assert got[("test_ttft_seconds_bucket", (("backend", "a"), ("le", "0.1")))] == 1 + 2
    assert got[("test_key_requests_total", (("key", "team"),))] == 8
    assert got[("test_lag_seconds_count", ())] == 8
    assert not any(name.endswith("_created") for name, _ in got)


def test_a_dead_workers_counts_stay_in_the_sums_so_nothing_goes_backwards() -> None:
    merger = merged(Worker().serve(10).registry, Worker().serve(4).registry)
    before = page(merger)[REQUESTS_A]
    merger.retire("w0")  # worker 0 crashed; its replacement starts from zero
    merger.update("w0-restarted", dump(Worker().serve(1).registry), worker="0")
    after = page(merger)
    assert before == 14
    assert after[REQUESTS_A] == 15
    assert after[("test_ttft_seconds_count", (("backend", "a"),))] == 15
    merger.retire("w1")
    merger.retire("w0-restarted")  # with nobody left, the page still shows what was counted
    assert page(merger)[REQUESTS_A] == 15


def test_a_counter_a_live_worker_made_anew_or_dropped_keeps_what_it_had_counted() -> None:
    worker = Worker().serve(6)
    merger = merged(worker.registry)
    fresh = Worker().serve(2)  # (the worker's state was recreated: its counter starts again)
    merger.update("w0", dump(fresh.registry), worker="0")
    assert page(merger)[REQUESTS_A] == 6 + 2
    merger.update("w0", dump(Worker().registry), worker="0")  # no series at all now
    assert page(merger)[REQUESTS_A] == 8
    merger.update("w0", dump(Worker().serve(1).registry), worker="0")
    assert page(merger)[REQUESTS_A] == 9


@pytest.mark.parametrize(("family", "values", "expected"), [
    ("gateway_backend_in_flight", [2.0, 3.0], 5.0),  # summed
    ("gateway_open_connections", [10.0, 7.0], 17.0),
    ("gateway_backend_up", [1.0, 0.0], 0.0),  # routable only where every worker routes to it
    ("gateway_backend_engine_waiting", [4.0, 4.0], 4.0),  # one probe: the same value everywhere
    ("gateway_backend_cost_per_million_tokens_usd", [20.0, 30.0], 12.0),  # 1/(1/20 + 1/30)
])
def test_gauges_merge_by_the_rule_their_definition_declares(family: str, values: list[float], expected: float) -> None:
    merger = merged(*(gauges({family: {("a",): v}}) for v in values))
    assert page(merger)[(family, (("backend", "a"),))] == pytest.approx(expected)


def test_the_descriptor_pair_is_shown_per_worker() -> None:
    pairs = [(100.0, 1024.0), (900.0, 1000.0)]
    got = page(merged(*(gauges({"process_open_fds": {(): opened}, "process_max_fds": {(): limit}}, labels=())
                        for opened, limit in pairs)))
    assert got[("process_open_fds", (("worker", "1"),))] / got[("process_max_fds", (("worker", "1"),))] == 0.9
    assert got[("process_open_fds", (("worker", "0"),))] == 100.0
    assert ("process_open_fds", ()) not in got


def test_a_dead_workers_gauges_are_gone() -> None:
    merger = merged(*(gauges({"gateway_backend_in_flight": {("a",): 3.0}}) for _ in range(2)))
    merger.retire("w0")
    assert page(merger)[("gateway_backend_in_flight", (("backend", "a"),))] == 3.0


def test_events_every_worker_observes_count_once() -> None:
    w0, w1 = Worker().count("test_answers", 7), Worker().count("test_answers", 7)
    merger = merged(w0.registry, w1.registry)
    assert page(merger)[ANSWERS] == 7  # not 14
    w0.count("test_answers", 9)
    merger.update("w0", dump(w0.registry), worker="0")
    w1.count("test_answers", 8)  # (worker 1 has not heard the last answer yet)
    merger.update("w1", dump(w1.registry), worker="1")
    assert page(merger)[ANSWERS] == 9


def test_when_the_oldest_worker_goes_the_next_continues_the_count() -> None:
    w0, w1 = Worker().count("test_answers", 10), Worker().count("test_answers", 10)
    merger = merged(w0.registry, w1.registry)
    merger.retire("w0")
    assert page(merger)[ANSWERS] == 10
    merger.update("w0-restarted", dump(Worker().count("test_answers", 1).registry), worker="0")
    assert page(merger)[ANSWERS] == 10  # what a new worker hears again was heard before
    w1.count("test_answers", 13)
    merger.update("w1", dump(w1.registry), worker="1")
    assert page(merger)[ANSWERS] == 13
    merger.retire("w1")  # the restarted worker is the oldest now: its progress counts from here
    merger.update("w0-restarted", dump(Worker().count("test_answers", 5).registry), worker="0")
    assert page(merger)[ANSWERS] == 13 + 4


def test_a_gauge_every_worker_observes_is_the_oldest_workers() -> None:
    w0, w1 = Worker().count("test_answers", 1), Worker().count("test_answers", 1)
    registries = []
    for worker, endpoints in ((w0, 2.0), (w1, 3.0)):
        worker.registry.register(Gauges({"test_endpoints": {("pool",): endpoints}}, labels=("source",)))
        registries.append(worker.registry)
    merger = merged(*registries)
    assert page(merger)[("test_endpoints", (("source", "pool"),))] == 2.0
    merger.retire("w0")
    assert page(merger)[("test_endpoints", (("source", "pool"),))] == 3.0


def test_a_workers_own_events_are_per_worker_and_continue_across_its_restarts() -> None:
    merger = merged(Worker().count("test_own_events", 4).registry, Worker().count("test_own_events", 1).registry)
    own = ("test_own_events_total", (("source", "pool"), ("worker", "0")))
    assert page(merger)[own] == 4
    merger.retire("w0")
    assert page(merger)[own] == 4
    merger.update("w0-restarted", dump(Worker().count("test_own_events", 2).registry), worker="0")
    got = page(merger)
    assert got[own] == 6
    assert got[("test_own_events_total", (("source", "pool"), ("worker", "1")))] == 1


def test_a_family_without_a_rule_is_never_summed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    merger = merged(*(gauges({"test_undeclared": {("a",): v}}) for v in (2.0, 3.0)))
    got = page(merger)
    assert got[("test_undeclared", (("backend", "a"), ("worker", "0")))] == 2.0
    assert got[("test_undeclared", (("backend", "a"), ("worker", "1")))] == 3.0
    page(merger)
    assert caplog.text.count("test_undeclared declares no merge rule") == 1


def test_openmetrics_is_served_when_asked() -> None:
    body, content_type = merged(Worker().serve(2).registry).render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


# A worker's life: it counts up (and may make its counters anew), reports, and may die and be replaced.
events = st.lists(st.tuples(st.sampled_from(["count", "reset", "report", "retire"]), st.integers(0, 2),
                            st.integers(0, 5)), max_size=40)


@settings(max_examples=200, deadline=None, database=None)
@given(events)
def test_no_merged_counter_ever_goes_backwards(steps: list[tuple[str, int, int]]) -> None:
    merger = ScrapeMerger()
    counts: dict[int, dict[str, float]] = {}  # slot -> the live worker's raw counters
    generation = dict.fromkeys(range(3), 0)
    before: Page = {}

    def report(slot: int) -> None:
        worker = Worker()
        for family, value in counts.setdefault(slot, {}).items():
            worker.count(family, value)
        merger.update(f"w{slot}-{generation[slot]}", dump(worker.registry), worker=str(slot))

    for action, slot, amount in steps:
        raw = counts.setdefault(slot, {})
        if action == "count":
            for family in ("test_answers", "test_own_events"):
                raw[family] = raw.get(family, 0.0) + amount
        elif action == "reset":
            raw.clear()
        elif action == "report":
            report(slot)
        else:
            merger.retire(f"w{slot}-{generation[slot]}")
            generation[slot] += 1
            raw.clear()
        now = page(merger)
        for key, value in before.items():
            assert now.get(key, 0.0) >= value, (key, steps)
        before = now
