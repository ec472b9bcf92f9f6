"""Exemplars: a histogram bucket's link to the trace of one request in it. Rendered in the OpenMetrics
exposition (never in the Prometheus text format, which has no place for them), and kept through the
supervisor's merge of its workers' pages: a merged bucket carries the newest exemplar any worker
reported, including one that has since gone."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from gateway.cluster.scrape import ScrapeMerger, dump
from gateway.merge_rules import Merge, declare
from gateway.observability.lockfree import FastHistogram

declare(Merge.SUM, "test_exemplar_seconds")
ACCEPT = "application/openmetrics-text; version=1.0.0"


def worker(observations: list[tuple[float, str | None, float]]) -> CollectorRegistry:
    registry = CollectorRegistry()
    h = FastHistogram("test_exemplar_seconds", "d", ("backend",), (0.1, 1.0))
    registry.register(h)
    child = h.labels("a")
    for value, trace, at in observations:
        if trace is None:
            child.observe(value)
        else:
            child.observe_exemplar(value, trace, at)
    return registry


def exemplars(text: str) -> dict[str, tuple[str, float, float | None]]:
    out = {}
    for family in text_string_to_metric_families(text):  # type: ignore[no-untyped-call]
        for s in family.samples:
            if s.exemplar is not None:
                at = None if s.exemplar.timestamp is None else float(s.exemplar.timestamp)
                out[s.labels["le"]] = (s.exemplar.labels["trace_id"], s.exemplar.value, at)
    return out


def test_each_bucket_carries_its_latest_traced_observation_in_openmetrics_only() -> None:
    registry = worker([(0.05, "a" * 32, 100.0), (0.07, None, 0.0), (0.08, "b" * 32, 101.0), (5.0, "c" * 32, 102.0)])
    text = generate_openmetrics(registry).decode()  # type: ignore[no-untyped-call]
    assert exemplars(text) == {"0.1": ("b" * 32, 0.08, 101.0), "+Inf": ("c" * 32, 5.0, 102.0)}
    assert "# {" not in generate_latest(registry).decode()
    counts = {s.labels["le"]: s.value for f in text_string_to_metric_families(text)  # type: ignore[no-untyped-call]
              for s in f.samples if s.name.endswith("_bucket")}
    assert counts == {"0.1": 3.0, "1.0": 3.0, "+Inf": 4.0}  # an exemplar is still one observation


def test_the_merge_keeps_the_newest_exemplar_of_each_bucket_even_from_a_retired_worker() -> None:
    merger = ScrapeMerger()
    merger.update("w1", dump(worker([(0.05, "1" * 32, 100.0), (0.5, "2" * 32, 100.0)])))
    merger.update("w2", dump(worker([(0.06, "3" * 32, 200.0), (0.7, None, 0.0)])))
    body, content_type = merger.render(ACCEPT)
    assert content_type.startswith("application/openmetrics-text")
    found = exemplars(body.decode())
    assert found["0.1"] == ("3" * 32, 0.06, 200.0)  # w2's is newer
    assert found["1.0"] == ("2" * 32, 0.5, 100.0)  # only w1 had one
    merger.retire("w1")
    assert exemplars(merger.render(ACCEPT)[0].decode())["1.0"] == ("2" * 32, 0.5, 100.0)  # a trace outlives its worker
    plain, _ = merger.render("text/plain")
    assert "# {" not in plain.decode()
