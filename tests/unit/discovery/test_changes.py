"""The loop every source goes through: counting, keeping the last set across failures, changes only."""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator

import pytest
from prometheus_client import CollectorRegistry

from gateway.discovery import Backoff, Change, DiscoveryMetrics, Endpoint, Failed, Observation, Resolved, changes, run

A, B, C = Endpoint("127.0.0.2", 8000), Endpoint("127.0.0.3", 8000), Endpoint("127.0.0.4", 8000)


class Scripted:
    """A source that plays a fixed list of observations, then ends (real sources never end)."""

    name = "pool"

    def __init__(self, *observations: Observation) -> None:
        self._observations = observations
        self.closed = False

    async def observe(self) -> AsyncGenerator[Observation, None]:
        try:
            for observation in self._observations:
                yield observation
        finally:
            self.closed = True


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    value: float | None = registry.get_sample_value(name, {"source": "pool", **labels})
    return value


async def test_only_changes_are_yielded_and_failures_keep_the_last_set() -> None:
    registry = CollectorRegistry()
    metrics = DiscoveryMetrics(registry)
    source = Scripted(
        Resolved(frozenset()), Resolved(frozenset({A, B})), Resolved(frozenset({A, B})), Failed("timed out"),
        Failed("timed out"), Resolved(frozenset({A, B})), Resolved(frozenset({B, C})),
    )
    seen = [c async for c in changes(source, metrics=metrics)]
    assert seen == [
        Change("pool", frozenset(), frozenset(), frozenset()),
        Change("pool", frozenset({A, B}), frozenset({A, B}), frozenset()),
        Change("pool", frozenset({B, C}), frozenset({C}), frozenset({A})),
    ]
    assert sample(registry, "gateway_discovery_resolutions_total") == 5
    assert sample(registry, "gateway_discovery_errors_total") == 2
    assert sample(registry, "gateway_discovery_changes_total", change="added") == 3
    assert sample(registry, "gateway_discovery_changes_total", change="removed") == 1
    assert sample(registry, "gateway_discovery_endpoints") == 2
    assert source.closed


async def test_failures_before_any_answer_yield_nothing() -> None:
    registry = CollectorRegistry()
    metrics = DiscoveryMetrics(registry)
    assert sample(registry, "gateway_discovery_errors_total") is None
    assert [c async for c in changes(Scripted(Failed("refused"), Failed("refused")), metrics=metrics)] == []
    assert sample(registry, "gateway_discovery_resolutions_total") == 0  # declared at zero by changes()
    assert sample(registry, "gateway_discovery_errors_total") == 2
    assert sample(registry, "gateway_discovery_endpoints") == 0


async def test_run_calls_back_for_every_change() -> None:
    got: list[frozenset[Endpoint]] = []
    await run(Scripted(Resolved(frozenset({A})), Resolved(frozenset({A})), Resolved(frozenset())),
              lambda c: got.append(c.endpoints))
    assert got == [frozenset({A}), frozenset()]


@pytest.mark.parametrize(("failures", "delay"), [(0, 0.5), (1, 0.5), (2, 1.0), (3, 2.0), (7, 30.0), (1000, 30.0)])
def test_backoff_doubles_up_to_its_cap(failures: int, delay: float) -> None:
    assert Backoff(jitter=0.0).delay(failures, random.Random(1)) == delay


def test_jitter_only_shortens() -> None:
    rng = random.Random(7)
    delays = [Backoff(initial_s=4, max_s=4, jitter=0.25).delay(3, rng) for _ in range(200)]
    assert all(3.0 <= d <= 4.0 for d in delays)
    assert max(delays) - min(delays) > 0.5
