"""The `gateway_discovery_*` metrics, on a registry the composition root passes in.

- `gateway_discovery_resolutions_total{source}`: answers a source gave (DNS: each successful
  resolution; Kubernetes: each list and each watch event that touched the watched objects).
- `gateway_discovery_changes_total{source,change="added"|"removed"}`: endpoints that joined or left.
- `gateway_discovery_errors_total{source}`: failed attempts (each is retried with backoff; the last
  known endpoints stay in force meanwhile).
- `gateway_discovery_endpoints{source}`: endpoints the source has in force now.
- `gateway_discovery_endpoints_missing{source}`: of those, the ones its last answer did not name,
  kept by the entry's hold (DNS `leave_after_answers` / `leave_after_s`) until absent long enough.
  Steadily above zero: the name server answers with subsets of the records.

`source` is the discovery entry's name: a config name, so the label set is bounded.

Under `--workers N` every worker follows every source itself, so each answer, change and error is
observed by every worker: these families merge `once` (`gateway.merge_rules`): the oldest worker's
counts are the gateway's, continued by the next oldest when it goes, so one endpoint joining counts
once, not once per worker.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..merge_rules import Merge, declare

declare(Merge.ONCE, "gateway_discovery_resolutions_total", "gateway_discovery_changes_total",
        "gateway_discovery_errors_total", "gateway_discovery_endpoints", "gateway_discovery_endpoints_missing")


class DiscoveryMetrics:
    """Counters and a gauge per source. Only `gateway.discovery.source.changes` calls these."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._resolutions = Counter(
            "gateway_discovery_resolutions_total", "Answers a discovery source gave.", ["source"], registry=registry
        )
        self._changes = Counter(
            "gateway_discovery_changes_total",
            "Endpoints that joined (added) or left (removed) a discovery source.",
            ["source", "change"],
            registry=registry,
        )
        self._errors = Counter(
            "gateway_discovery_errors_total",
            "Failed discovery attempts (the last known endpoints stay in force).",
            ["source"],
            registry=registry,
        )
        self._endpoints = Gauge(
            "gateway_discovery_endpoints", "Endpoints a discovery source has now.", ["source"], registry=registry
        )
        self._missing = Gauge(
            "gateway_discovery_endpoints_missing",
            "Endpoints in force that the source's last answer did not name (held until absent long enough).",
            ["source"],
            registry=registry,
        )
        self._declared: set[str] = set()

    def declare(self, source: str) -> None:
        """Create the source's series at zero, so that they exist before its first answer (a source
        that starts again, after a reload changed it, keeps its series and its endpoint count)."""
        if source in self._declared:
            return
        self._declared.add(source)
        self._resolutions.labels(source)
        self._errors.labels(source)
        self._changes.labels(source, "added")
        self._changes.labels(source, "removed")
        self._endpoints.labels(source).set(0)
        self._missing.labels(source).set(0)

    def resolved(self, source: str, *, missing: int = 0) -> None:
        self._resolutions.labels(source).inc()
        self._missing.labels(source).set(missing)

    def failed(self, source: str) -> None:
        self._errors.labels(source).inc()

    def changed(self, source: str, *, added: int, removed: int, now: int) -> None:
        if added:
            self._changes.labels(source, "added").inc(added)
        if removed:
            self._changes.labels(source, "removed").inc(removed)
        self._endpoints.labels(source).set(now)
