"""One call from the composition root wires every observability family of this room."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry

from .arms import ArmMetrics
from .info import PriceCollector, PricedBackend
from .outcome import Outcome
from .process import SelfHealth


def install(
    app: web.Application,
    registry: CollectorRegistry,
    *,
    backends: Callable[[], Iterable[PricedBackend]],
    observers: list[Callable[[Outcome], None]],
    connections: dict[str, Callable[[], int]] | None = None,
) -> SelfHealth:
    """Register the self-health, price and per-arm families on `registry`, run the event-loop probe
    for the application's lifetime, and append the per-arm observer to `observers` (a Recorder's).

    `backends()` returns the live config's backends (read at every scrape). Connection counts can be
    given now or added later with `health.connections.add(side, count)` on the returned object (the
    front and its listener exist only after the application is built)."""
    health = SelfHealth(registry, connections=connections)
    app.cleanup_ctx.append(health.lifetime)
    registry.register(PriceCollector(backends))
    observers.append(ArmMetrics(registry).record)
    return health
