"""The KV-event caches' state for Prometheus, read when it scrapes (nothing on the request path).

A backend's cache is made anew when a reload changes how its events are heard, or when the backend
leaves the config and comes back (`intake.reconcile`); its counters here continue from what the
earlier caches of the same backend had counted, so they never go backwards.

Under `--workers N` (`gateway.merge_rules`) every worker keeps its own index of the same engine's
cache: the index is live for the gateway only where it is live in every worker (`min`), blocks and
batch age are one engine's (`max`: the stalest worker shows), every worker receives the engine's
batches (`once`), and each worker's index is reset on its own (`sum`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..merge_rules import Merge, declare
from .cache import Stats
from .registry import KvCaches

declare(Merge.MIN, "gateway_kv_events_live")
declare(Merge.MAX, "gateway_kv_events_last_batch_age_seconds", "gateway_kv_index_blocks", "gateway_kv_events_silent")
declare(Merge.ONCE, "gateway_kv_events_batches")
declare(Merge.SUM, "gateway_kv_index_resets")


@dataclass
class _Counted:
    """One backend's counters: the cache's `stats` read now, plus what its earlier caches counted."""

    stats: Stats
    batches: int = 0
    resets: dict[str, int] = field(default_factory=dict)

    def follow(self, stats: Stats) -> None:
        if stats is self.stats:
            return
        self.batches += self.stats.batches
        for reason, n in self.stats.resets.items():
            self.resets[reason] = self.resets.get(reason, 0) + n
        self.stats = stats


class KvCollector:
    """`gateway_kv_events_*` families, one series per backend that publishes events."""

    def __init__(self, caches: KvCaches) -> None:
        self._caches = caches
        self._counted: dict[str, _Counted] = {}

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
            counted = self._counted.get(cache.name)
            if counted is None:
                counted = self._counted[cache.name] = _Counted(cache.stats)
            counted.follow(cache.stats)
            live.add_metric(lv, 1.0 if cache.live else 0.0)
            silent.add_metric(lv, 1.0 if cache.silent else 0.0)
            if cache.last_batch_at is not None:
                age.add_metric(lv, max(now - cache.last_batch_at, 0.0))
            blocks.add_metric(lv, float(sum(len(r.index) for r in cache.ranks.values())))
            batches.add_metric(lv, float(counted.batches + cache.stats.batches))
            for reason in sorted({*counted.resets, *cache.stats.resets}):
                n = counted.resets.get(reason, 0) + cache.stats.resets.get(reason, 0)
                resets.add_metric([cache.name, reason], float(n))
        yield from (live, silent, age, blocks, batches, resets)
