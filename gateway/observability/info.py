"""Configuration facts as Prometheus series, for rules that combine them with measurements.

`gateway_backend_usd_per_hour{backend, runtime}` is each backend's configured price (backends without
`usd_per_hour` have no sample). Prometheus then computes cost per 1M output tokens from it and the
measured token rate (`deploy/prometheus/rules/`), over any window and summed over replicas, which the
gateway's own 60 s gauge (`gateway_backend_cost_per_million_tokens_usd`) cannot do. The price is a
property of the backend, not of the gateway process: several workers or replicas export the same
value, and rules take `max` over them, never `sum`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily

from ..merge_rules import Merge, declare

declare(Merge.MAX, "gateway_backend_usd_per_hour")  # the config's, the same in every worker


class PricedBackend(Protocol):
    """What the collector reads of a configured backend (`settings.Backend` has these)."""

    @property
    def name(self) -> str: ...

    @property
    def runtime(self) -> str: ...

    @property
    def usd_per_hour(self) -> float | None: ...


class PriceCollector:
    """Reads the backends from `backends()` at every scrape, so a reloaded config's prices show at once."""

    def __init__(self, backends: Callable[[], Iterable[PricedBackend]]) -> None:
        self._backends = backends

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "gateway_backend_usd_per_hour", "The backend's configured price (backends[].usd_per_hour) in USD per hour.",
            labels=["backend", "runtime"],
        )
        for b in self._backends():
            if b.usd_per_hour is not None:
                family.add_metric([b.name, str(b.runtime)], float(b.usd_per_hour))
        yield family
