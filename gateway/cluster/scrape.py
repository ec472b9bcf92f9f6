"""One /metrics page for the whole gateway, merged from every worker's families.

Why not prometheus_client's multiprocess mode: it works by giving each *prometheus_client* metric an
mmap file, and the gateway's request families are its own lock-free collectors (`lockfree`) and
scrape-time collectors (pool gauges, the live comparison), which it cannot see. So the supervisor
asks each worker for its families (`dump`: the registry's collected samples as plain data, over the
worker's private channel) and serves their merge, the way Envoy's hot restart merges the stats of
its generations:

- counters and histograms (`_total`, `_bucket`, `_count`, `_sum`) are summed over the workers, and a
  worker that died keeps contributing the last values it reported (`retire`), so every series stays
  monotonic from scrape to scrape while workers come and go (only what a crashed worker counted
  after its last report is lost; the supervisor asks every few seconds besides each scrape);
- gauges are summed (in flight, open connections, memory, live throughput) unless `GAUGES` says
  otherwise: values that every worker reads from the one shared probe (engine load) or the config
  (prices, build) are the same everywhere and taken once (`max`); `gateway_backend_up` is 1 only
  when every worker routes to the backend (`min`: outlier ejection is per worker); the live cost
  per 1M tokens is recomputed for the summed throughput (`harmonic`: 1/c = sum of 1/c_i, exact for
  c_i = price / throughput_i); the descriptor pair is the one worker nearest its own limit (the
  limit is per process, so a sum would hide it);
- `_created` samples are dropped: a sum of several processes' creation times means nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder

Labels = tuple[tuple[str, str], ...]
Dump = list[list[Any]]  # [[name, type, documentation, unit, [[sample name, labels, value], ...]], ...]

MONOTONIC_TYPES = frozenset({"counter", "histogram", "summary"})
MONOTONIC_SUFFIXES = ("_total", "_bucket", "_count", "_sum")

GAUGES: Mapping[str, str] = {
    "gateway_backend_up": "min",
    "gateway_backend_engine_running": "max",
    "gateway_backend_engine_waiting": "max",
    "gateway_backend_engine_kv_cache_usage_ratio": "max",
    "gateway_backend_engine_prefix_cache_hit_ratio": "max",
    "gateway_backend_usd_per_hour": "max",
    "gateway_build_info": "max",
    "gateway_state_store_up": "min",
    "gateway_backend_cost_per_million_tokens_usd": "harmonic",
    "process_start_time_seconds": "min",
}
FD_PAIR = ("process_open_fds", "process_max_fds")


def dump(registry: CollectorRegistry) -> Dump:
    """Every family `registry` collects now, as plain data (for the channel)."""
    out: Dump = []
    for m in registry.collect():
        samples = [[s.name, s.labels, s.value] for s in m.samples if not s.name.endswith("_created")]
        out.append([m.name, m.type, m.documentation, m.unit, samples])
    return out


def _key(labels: Mapping[str, str]) -> Labels:
    return tuple(sorted(labels.items()))


def _value(raw: Any) -> float:
    return math.nan if raw is None else float(raw)  # orjson writes NaN as null


def _monotonic(kind: str, sample: str) -> bool:
    return kind in MONOTONIC_TYPES and sample.endswith(MONOTONIC_SUFFIXES)


def _combine(policy: str, values: list[float]) -> float:
    if policy == "min":
        return min(values)
    if policy == "max":
        return max(values)
    if policy == "harmonic":
        inverse = math.fsum(1.0 / v for v in values if v > 0)
        return 1.0 / inverse if inverse > 0 else math.nan
    return math.fsum(values)


class ScrapeMerger:
    """The latest dump of every live source, plus the retired monotonic totals of dead ones."""

    def __init__(self) -> None:
        self._live: dict[str, Dump] = {}
        self._retired: dict[tuple[str, str, Labels], float] = {}
        self._meta: dict[str, tuple[str, str, str]] = {}  # family -> (type, documentation, unit)
        self._order: dict[str, dict[tuple[str, Labels], dict[str, str]]] = {}  # first-seen sample order

    @property
    def sources(self) -> list[str]:
        return list(self._live)

    def update(self, source: str, families: Dump) -> None:
        self._live[source] = families
        for name, kind, doc, unit, samples in families:
            self._meta.setdefault(name, (kind, doc, unit))
            order = self._order.setdefault(name, {})
            for sample, labels, _ in samples:
                order.setdefault((sample, _key(labels)), labels)

    def retire(self, source: str) -> None:
        """`source` is gone: its counters and histograms stay in every sum from now on, its gauges go."""
        families = self._live.pop(source, None)
        for name, kind, _, _, samples in families or ():
            for sample, labels, value in samples:
                if _monotonic(kind, sample):
                    key = (name, sample, _key(labels))
                    self._retired[key] = self._retired.get(key, 0.0) + _value(value)

    def families(self) -> Iterator[Metric]:
        collected: dict[str, dict[tuple[str, Labels], list[tuple[str, float]]]] = {}
        for source, families in self._live.items():
            for name, _, _, _, samples in families:
                into = collected.setdefault(name, {})
                for sample, labels, value in samples:
                    into.setdefault((sample, _key(labels)), []).append((source, _value(value)))
        fd_source = self._fd_source(collected)
        for name, (kind, doc, unit) in self._meta.items():
            metric = Metric(name, doc, kind, unit)
            seen = collected.get(name, {})
            for (sample, key), labels in self._order[name].items():
                values = seen.get((sample, key), [])
                if _monotonic(kind, sample):
                    retired = self._retired.get((name, sample, key))
                    if not values and retired is None:
                        continue
                    metric.add_sample(sample, labels, math.fsum(v for _, v in values) + (retired or 0.0))
                elif values:
                    if name in FD_PAIR and fd_source is not None:
                        chosen = [v for s, v in values if s == fd_source] or [v for _, v in values]
                        metric.add_sample(sample, labels, chosen[0])
                    else:
                        metric.add_sample(sample, labels, _combine(GAUGES.get(name, "sum"), [v for _, v in values]))
            if metric.samples:
                yield metric

    @staticmethod
    def _fd_source(collected: Mapping[str, Mapping[tuple[str, Labels], list[tuple[str, float]]]]) -> str | None:
        opened = {s: v for values in collected.get(FD_PAIR[0], {}).values() for s, v in values}
        limits = {s: v for values in collected.get(FD_PAIR[1], {}).values() for s, v in values}
        ratios = {s: opened[s] / limits[s] for s in opened if limits.get(s)}
        return max(ratios, key=lambda s: ratios[s]) if ratios else None

    def render(self, accept: str) -> tuple[bytes, str]:
        """The merged page, encoded as `accept` asks (text 0.0.4 or OpenMetrics)."""
        encoder, content_type = choose_encoder(accept)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Frozen(list(self.families())))
        body: bytes = encoder(registry)
        return body, content_type


class _Frozen:
    def __init__(self, metrics: Iterable[Metric]) -> None:
        self._metrics = list(metrics)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self._metrics
