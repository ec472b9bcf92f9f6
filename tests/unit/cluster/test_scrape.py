"""Worker scrapes merged into one page: sums, monotonic across worker restarts, gauges that mean
something for the whole gateway."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from gateway.cluster.scrape import ScrapeMerger, dump
from gateway.observability.lockfree import FastCounter, FastHistogram


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


class Worker:
    """One worker's registry: the lock-free request families and a prometheus_client counter."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = FastCounter("gateway_requests", "Requests.", ("backend", "status"))
        self.ttft = FastHistogram("gateway_time_to_first_token_seconds", "TTFT.", ("backend",), (0.1, 1.0))
        self.registry.register(self.requests)
        self.registry.register(self.ttft)
        self.keys = Counter("gateway_key_requests", "Per key.", ("key",), registry=self.registry)
        self.lag = Histogram("gateway_event_loop_lag_seconds", "Lag.", buckets=(0.01,), registry=self.registry)
        self.gauges = Gauges({})
        self.registry.register(self.gauges)

    def serve(self, n: int, backend: str = "a") -> None:
        for i in range(n):
            self.requests.labels(backend, "200").inc()
            self.ttft.labels(backend).observe(0.05 if i % 2 else 0.5)
            self.keys.labels("team").inc()
            self.lag.observe(0.001)


def page(merger: ScrapeMerger) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = merger.render("")
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


REQUESTS_A = ("gateway_requests_total", (("backend", "a"), ("status", "200")))


def merged(*registries: CollectorRegistry) -> ScrapeMerger:
    """A merger that has one scrape of each registry, as workers w0, w1, ..."""
    merger = ScrapeMerger()
    for i, registry in enumerate(registries):
        merger.update(f"w{i}", dump(registry))
    return merger


def serving(*requests: int) -> list[CollectorRegistry]:
    """The registries of workers that have served `requests[i]` requests each."""
    workers = [Worker() for _ in requests]
    for worker, n in zip(workers, requests, strict=True):
        worker.serve(n)
    return [w.registry for w in workers]


def gauges(values: dict[str, dict[tuple[str, ...], float]], labels: tuple[str, ...] = ("backend",),
           ) -> CollectorRegistry:
    """A worker's registry holding only these gauge families."""
    registry = CollectorRegistry()
    registry.register(Gauges(values, labels))
    return registry


def test_counters_and_histograms_are_summed_over_workers() -> None:
    got = page(merged(*serving(3, 5)))
    assert got[REQUESTS_A] == 8
    assert got[("gateway_time_to_first_token_seconds_count", (("backend", "a"),))] == 8
    assert got[("gateway_time_to_first_token_seconds_bucket", (("backend", "a"), ("le", "0.1")))] == 1 + 2
    assert got[("gateway_key_requests_total", (("key", "team"),))] == 8
    assert got[("gateway_event_loop_lag_seconds_count", ())] == 8
    assert not any(name.endswith("_created") for name, _ in got)


def test_a_dead_workers_counts_stay_in_the_sums_so_nothing_goes_backwards() -> None:
    merger = merged(*serving(10, 4))
    before = page(merger)[REQUESTS_A]
    merger.retire("w0")  # worker 0 crashed; its replacement starts from zero
    merger.update("w0-restarted", dump(serving(1)[0]))
    after = page(merger)
    assert before == 14
    assert after[REQUESTS_A] == 15
    assert after[("gateway_time_to_first_token_seconds_count", (("backend", "a"),))] == 15
    merger.retire("w1")
    merger.retire("w0-restarted")  # with nobody left, the page still shows what was counted
    assert page(merger)[REQUESTS_A] == 15


@pytest.mark.parametrize(("family", "values", "expected"), [
    ("gateway_backend_in_flight", [2.0, 3.0], 5.0),  # summed
    ("gateway_open_connections", [10.0, 7.0], 17.0),
    ("gateway_backend_up", [1.0, 0.0], 0.0),  # routable only where every worker routes to it
    ("gateway_backend_engine_waiting", [4.0, 4.0], 4.0),  # one probe: the same value everywhere
    ("gateway_backend_usd_per_hour", [96.0, 96.0], 96.0),
    ("gateway_backend_cost_per_million_tokens_usd", [20.0, 30.0], 12.0),  # 1/(1/20 + 1/30)
])
def test_gauges_merge_by_what_they_mean(family: str, values: list[float], expected: float) -> None:
    merger = merged(*(gauges({family: {("a",): v}}) for v in values))
    assert page(merger)[(family, (("backend", "a"),))] == pytest.approx(expected)


def test_the_descriptor_pair_is_the_worker_nearest_its_limit() -> None:
    pairs = [(100.0, 1024.0), (900.0, 1000.0), (10.0, 65536.0)]
    got = page(merged(*(gauges({"process_open_fds": {(): opened}, "process_max_fds": {(): limit}}, labels=())
                        for opened, limit in pairs)))
    assert got[("process_open_fds", ())] / got[("process_max_fds", ())] == pytest.approx(0.9)


def test_a_dead_workers_gauges_are_gone() -> None:
    merger = merged(*(gauges({"gateway_backend_in_flight": {("a",): 3.0}}) for _ in range(2)))
    merger.retire("w0")
    assert page(merger)[("gateway_backend_in_flight", (("backend", "a"),))] == 3.0


def test_openmetrics_is_served_when_asked() -> None:
    body, content_type = merged(*serving(2)).render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
