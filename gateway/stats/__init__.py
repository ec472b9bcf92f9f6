"""Live throughput, latency and cost comparison over sliding windows, and A/B statistics.

Roles: `quantiles` (bounded reservoirs, percentiles), `window` (time buckets; tokens spread over
their generation time), `peak` (the decaying best-throughput figure), `book` (groups fed by every
Outcome), `figures` (one group over one window), `cost`, `ab` (bootstrap, SRM, verdict), `compare`
(the JSON document), `prom` (Prometheus gauges).
"""

from .book import StatsBook, WeightsFn, configured_weights
from .compare import WINDOWS_S, Comparer
from .prom import LiveCollector

__all__ = ["WINDOWS_S", "Comparer", "LiveCollector", "StatsBook", "WeightsFn", "configured_weights"]
