"""A backend's KV-event counters on /metrics continue across the caches a reload or a re-join makes
anew: they never go backwards."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.kvcache.collector import KvCollector
from gateway.kvcache.registry import KvCaches


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples}


BATCHES = ("gateway_kv_events_batches_total", (("backend", "v"),))
GAPS = ("gateway_kv_index_resets_total", (("backend", "v"), ("reason", "gap")))


def test_counters_continue_across_a_cache_made_anew() -> None:
    caches = KvCaches(clock=lambda: 0.0)
    registry = CollectorRegistry()
    registry.register(KvCollector(caches))
    first = caches.add("v")
    first.stats.batches, first.stats.resets["gap"] = 5, 1
    assert samples(registry)[BATCHES] == 5
    first.stats.batches = 7  # more batches after the last scrape, before the reload
    caches.drop("v")  # a reload changed how its events are heard (`intake.reconcile`)
    second = caches.add("v")
    second.stats.batches, second.stats.resets["restart"] = 2, 1
    got = samples(registry)
    assert got[BATCHES] == 7 + 2
    assert got[GAPS] == 1
    assert got[("gateway_kv_index_resets_total", (("backend", "v"), ("reason", "restart")))] == 1
    caches.retain([])  # the backend left the config: its series go ...
    assert BATCHES not in samples(registry)
    caches.add("v").stats.batches = 1  # ... and come back where they were when it returns
    assert samples(registry)[BATCHES] == 10
