from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from backends.base import Load, LoadParseError, Probe
from backends.vllm import VLLMAdapter

from .captures import openmetrics_latest, response

ADAPTER = VLLMAdapter()


def test_probes_and_load_path() -> None:
    assert ADAPTER.liveness == Probe("/health")
    assert ADAPTER.readiness == Probe("/health")
    assert ADAPTER.load_path == "/metrics"
    assert response("health.txt").status in ADAPTER.readiness.ok


@pytest.mark.parametrize("capture", ["metrics.txt", "metrics_openmetrics.txt"])
def test_parse_load_on_real_vllm_metrics(capture: str) -> None:
    load = ADAPTER.parse_load(response(capture).body, None)
    assert load == Load(
        running=0.0,
        waiting=0.0,
        kv_usage=0.0,
        prefix_hit_rate=768 / 1844,
        block_size=128,
        prefix_queries_total=1844.0,
        prefix_hits_total=768.0,
    )


def test_hit_rate_uses_the_interval_since_the_previous_scrape() -> None:
    body = response("metrics.txt").body
    previous = Load(prefix_queries_total=1000.0, prefix_hits_total=700.0)
    assert ADAPTER.parse_load(body, previous).prefix_hit_rate == pytest.approx(68 / 844)
    # No new queries, or a counter reset (engine restart): fall back to the cumulative ratio.
    for prev in (Load(prefix_queries_total=1844.0, prefix_hits_total=768.0), Load(prefix_queries_total=9e9)):
        assert ADAPTER.parse_load(body, prev).prefix_hit_rate == pytest.approx(768 / 1844)


def _two_engine_registry(*, old_names: bool) -> CollectorRegistry:
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "r", labels, registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "w", labels, registry=registry)
    kv_name = "vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc"
    kv = Gauge(kv_name, "kv", labels, registry=registry)
    prefix = "vllm:gpu_prefix_cache" if old_names else "vllm:prefix_cache"
    queries = Counter(f"{prefix}_queries", "q", labels, registry=registry)
    hits = Counter(f"{prefix}_hits", "h", labels, registry=registry)
    info = Gauge("vllm:cache_config_info", "i", ["block_size", "engine"], registry=registry)
    for engine, (r, w, k, q, h) in {"0": (7, 2, 0.25, 100, 40), "1": (3, 1, 0.75, 300, 20)}.items():
        running.labels("m", engine).set(r)
        waiting.labels("m", engine).set(w)
        kv.labels("m", engine).set(k)
        queries.labels("m", engine).inc(q)
        hits.labels("m", engine).inc(h)
        info.labels("16", engine).set(1)
    return registry


@pytest.mark.parametrize("old_names", [False, True])
def test_openmetrics_two_engines_and_pre_0_11_names(old_names: bool) -> None:
    body = openmetrics_latest(_two_engine_registry(old_names=old_names))
    load = ADAPTER.parse_load(body, None)
    assert (load.running, load.waiting, load.kv_usage) == (10.0, 3.0, 0.5)
    assert (load.prefix_hits_total, load.prefix_queries_total, load.block_size) == (60.0, 400.0, 16)
    assert load.prefix_hit_rate == pytest.approx(0.15)


@pytest.mark.parametrize(
    "body", [b"", b"# HELP python_info x\n# TYPE python_info gauge\npython_info 1.0\n", b"<html>oops</html>"]
)
def test_bodies_without_vllm_metrics_raise_load_parse_error(body: bytes) -> None:
    with pytest.raises(LoadParseError):
        ADAPTER.parse_load(body, None)
