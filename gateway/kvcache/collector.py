"""The KV-event caches' state for Prometheus, read when it scrapes (nothing on the request path)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .registry import KvCaches


class KvCollector:
    """`gateway_kv_events_*` families, one series per backend that publishes events."""

    def __init__(self, caches: KvCaches) -> None:
        self._caches = caches

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = self._caches.clock()
        live = GaugeMetricFamily(
            "gateway_kv_events_live", "1 when routing uses the backend's KV events (exact prefix hits); 0 while it "
            "waits for them or rebuilds after lost events (the approximate index routes).", labels=["backend"])
        silent = GaugeMetricFamily(
            "gateway_kv_events_silent", "1 while the backend's KV-event source is silent: no batch (ever, or since) "
            "within silent_after_s of a response that showed the engine stored new blocks; /admin/backends and the "
            "log say why.", labels=["backend"])
        age = GaugeMetricFamily(
            "gateway_kv_events_last_batch_age_seconds", "Seconds since the backend's last KV event batch.",
            labels=["backend"])
        blocks = GaugeMetricFamily(
            "gateway_kv_index_blocks", "Blocks the backend holds by its KV events (all DP ranks).", labels=["backend"])
        batches = CounterMetricFamily(
            "gateway_kv_events_batches", "KV event batches received (trtllm-serve: answered polls).",
            labels=["backend"])
        resets = CounterMetricFamily(
            "gateway_kv_index_resets", "Times the backend's event-built index was cleared or distrusted, by reason "
            "(cleared, restart, gap, joined late, silent, intake failed).", labels=["backend", "reason"])
        for cache in self._caches:
            lv = [cache.name]
            live.add_metric(lv, 1.0 if cache.live else 0.0)
            silent.add_metric(lv, 1.0 if cache.silent else 0.0)
            if cache.last_batch_at is not None:
                age.add_metric(lv, max(now - cache.last_batch_at, 0.0))
            blocks.add_metric(lv, float(sum(len(r.index) for r in cache.ranks.values())))
            batches.add_metric(lv, float(cache.stats.batches))
            for reason, n in sorted(cache.stats.resets.items()):
                resets.add_metric([cache.name, reason], float(n))
        yield from (live, silent, age, blocks, batches, resets)
