"""Live comparison figures as Prometheus gauges, computed from the stats book at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from ..merge_rules import Merge, declare
from .book import StatsBook
from .figures import figures

LIVE_WINDOW_S = 60

# Under `--workers N`, each worker's throughput is its share; the cost of the whole gateway's is
# recomputed from the workers' (1/c = sum of 1/c_i: c_i = price / throughput_i).
declare(Merge.SUM, "gateway_backend_output_tokens_per_second")
declare(Merge.HARMONIC, "gateway_backend_cost_per_million_tokens_usd")


class LiveCollector:
    """`gateway_backend_output_tokens_per_second` and `gateway_backend_cost_per_million_tokens_usd`
    over the last 60 s, per backend (a backend without a price or without traffic has no cost sample); the
    throughput is the `output_tokens_per_s` of `/admin/compare` (`figures`)."""

    def __init__(self, book: StatsBook, clock: Callable[[], float]) -> None:
        self._book = book
        self._clock = clock

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["backend", "runtime"]
        tps = GaugeMetricFamily(
            "gateway_backend_output_tokens_per_second",
            f"Output tokens/s per backend generated in the last {LIVE_WINDOW_S} s, measured at the gateway "
            "(finished requests' tokens spread over their generation time).", labels=labels,
        )
        cost = GaugeMetricFamily(
            "gateway_backend_cost_per_million_tokens_usd",
            f"usd_per_hour / (3600 x output tokens/s) x 1e6 over the last {LIVE_WINDOW_S} s.", labels=labels,
        )
        now = self._clock()
        for g in self._book.backends.values():
            f = figures(self._book, g, now, LIVE_WINDOW_S)
            lv = [g.name, g.runtime or ""]
            tps.add_metric(lv, f["output_tokens_per_s"] or 0.0)
            usd = f["cost"]["usd_per_million_output_tokens"]
            if usd is not None:
                cost.add_metric(lv, usd)
        yield tps
        yield cost
