"""Per-rank families of backends with data-parallel ranks (`backends[].data_parallel_size`).

A wide server is one backend in every per-backend family (health, ejection, its requests and
tokens as a whole); these families add its ranks, under a `rank` label (the rank's number, so at
most `data_parallel_size` <= 64 values per backend, and only backends with ranks have any):

- `gateway_rank_responses_total{backend, rank, status}`: finished requests pinned to the rank;
- `gateway_rank_tokens_total{backend, rank, kind}`: their prompt, completion and cached tokens;
- `gateway_rank_time_to_first_token_seconds{backend, rank}`: the per-backend histogram's buckets;
- `gateway_rank_in_flight{backend, rank}`: requests the gateway has open to the rank;
- `gateway_rank_engine_running`, `_waiting`, `_kv_cache_usage_ratio{backend, rank}`: what the
  engine reports per rank (vLLM's `engine` label, SGLang's `dp_rank`), when it breaks them down.

A `rank` label rather than a per-rank `backend` value: the per-backend families keep meaning the
server (a dashboard's sum over `backend` is unchanged, and health and ejection are the server's),
and a rank's figures are one `sum by (backend)` away from the server's. Merge rules, under
`--workers N`: counters, histograms and in-flight counts add up (each worker's own requests); the
engine's gauges come from the supervisor's one scrape (`max`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from ..merge_rules import Merge, declare
from ..state.pool import Pool
from .lockfree import CounterChild, FastCounter, FastHistogram, HistogramChild
from .metrics import TTFT_BUCKETS
from .outcome import Outcome

declare(Merge.SUM, "gateway_rank_in_flight")
declare(Merge.MAX, "gateway_rank_engine_running", "gateway_rank_engine_waiting",
        "gateway_rank_engine_kv_cache_usage_ratio")


@dataclass(slots=True)
class _RankSeries:
    prompt: CounterChild
    completion: CounterChild
    cached: CounterChild
    ttft: HistogramChild
    statuses: dict[str, CounterChild]


class RankMetrics:
    """A `Recorder` observer (requests pinned to a rank) and a collector (per-rank gauges from the
    pool at scrape time). Requests that were not pinned cost one attribute test."""

    def __init__(self, registry: CollectorRegistry, pool: Pool) -> None:
        labels = ("backend", "rank")
        self.responses = FastCounter(
            "gateway_rank_responses", "Finished requests pinned to each data-parallel rank, by outcome.",
            (*labels, "status"))
        self.tokens = FastCounter(
            "gateway_rank_tokens", "Tokens of the requests pinned to each data-parallel rank, by kind.",
            (*labels, "kind"))
        self.ttft = FastHistogram(
            "gateway_rank_time_to_first_token_seconds",
            "Time to the first streamed event, per data-parallel rank.", labels, TTFT_BUCKETS)
        for family in (self.responses, self.tokens, self.ttft):
            declare(Merge.SUM, family.name)  # each worker counts the requests it served
            registry.register(family)
        registry.register(_RankCollector(pool))
        self._series: dict[tuple[str, int], _RankSeries] = {}

    def record(self, o: Outcome) -> None:
        rank = o.rank
        if rank is None:
            return
        key = (o.backend, rank)
        s = self._series.get(key)
        if s is None:
            lv = (o.backend, str(rank))
            s = self._series[key] = _RankSeries(
                prompt=self.tokens.labels(*lv, "prompt"), completion=self.tokens.labels(*lv, "completion"),
                cached=self.tokens.labels(*lv, "cached"), ttft=self.ttft.labels(*lv), statuses={},
            )
        status = s.statuses.get(o.status)
        if status is None:
            status = s.statuses[o.status] = self.responses.labels(o.backend, str(rank), o.status)
        status.inc()
        usage = o.usage
        if usage is not None:
            s.prompt.inc(usage.prompt_tokens)
            s.completion.inc(usage.completion_tokens)
            if usage.cached_tokens:
                s.cached.inc(usage.cached_tokens)
        if o.ttft_s is not None:
            s.ttft.observe(o.ttft_s)


class _RankCollector:
    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["backend", "rank"]
        in_flight = GaugeMetricFamily("gateway_rank_in_flight",
                                      "Requests the gateway has open to each data-parallel rank.", labels=labels)
        fams = {
            "running": GaugeMetricFamily("gateway_rank_engine_running",
                                         "Engine-reported running requests of each data-parallel rank.", labels=labels),
            "waiting": GaugeMetricFamily("gateway_rank_engine_waiting",
                                         "Engine-reported waiting requests of each data-parallel rank.", labels=labels),
            "kv_usage": GaugeMetricFamily("gateway_rank_engine_kv_cache_usage_ratio",
                                          "Engine-reported KV-cache usage (0-1) of each data-parallel rank.",
                                          labels=labels),
        }
        for s in self._pool:
            per_rank = s.load.per_rank
            for r, count in enumerate(s.rank_in_flight):
                lv = [s.name, str(r)]
                in_flight.add_metric(lv, float(count))
                if r < len(per_rank):
                    for key, fam in fams.items():
                        value = getattr(per_rank[r], key)
                        if value is not None:
                            fam.add_metric(lv, float(value))
        yield in_flight
        yield from fams.values()
