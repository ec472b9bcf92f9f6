"""A discovery source that starts again (a reload changed it) keeps its series: its endpoint count
stays what is in force until its first answer, and its counters go on."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.discovery.metrics import DiscoveryMetrics


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    got = registry.get_sample_value(name, {"source": "pool", **labels})
    return got


def test_declaring_a_source_again_keeps_its_series() -> None:
    registry = CollectorRegistry()
    metrics = DiscoveryMetrics(registry)
    metrics.declare("pool")
    assert value(registry, "gateway_discovery_endpoints") == 0
    metrics.resolved("pool")
    metrics.changed("pool", added=2, removed=0, now=2)
    metrics.declare("pool")  # the source restarted: its last set stays in force until it answers
    assert value(registry, "gateway_discovery_endpoints") == 2
    assert value(registry, "gateway_discovery_changes_total", change="added") == 2
    assert value(registry, "gateway_discovery_resolutions_total") == 1
