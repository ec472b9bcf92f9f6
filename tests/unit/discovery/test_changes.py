"""The loop every source goes through: counting, keeping the last set across failures, changes only."""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator

import pytest
from prometheus_client import CollectorRegistry

from gateway.discovery import Backoff, Change, DiscoveryMetrics, Endpoint, Failed, Observation, Resolved, changes, run
from gateway.discovery.hysteresis import Hold

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


class Ticks:
    """A clock that moves one second each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


async def test_a_hold_keeps_endpoints_an_answer_leaves_out_and_failures_do_not_count() -> None:
    registry = CollectorRegistry()
    source = Scripted(
        Resolved(frozenset({A, B, C})), Resolved(frozenset({A, B})), Resolved(frozenset({B, C})),
        Failed("timed out"), Failed("timed out"), Resolved(frozenset({A, C})), Resolved(frozenset({A, C})),
        Resolved(frozenset({A})),
    )
    seen = [c async for c in changes(source, metrics=DiscoveryMetrics(registry), hold=Hold(answers=2, seconds=0.0),
                                     clock=Ticks())]
    assert seen == [  # rotating subsets: nothing leaves; B only after two answers in a row without it
        Change("pool", frozenset({A, B, C}), frozenset({A, B, C}), frozenset()),
        Change("pool", frozenset({A, C}), frozenset(), frozenset({B})),
    ]
    assert sample(registry, "gateway_discovery_endpoints") == 2
    assert sample(registry, "gateway_discovery_endpoints_missing") == 1  # C, missing once
    assert sample(registry, "gateway_discovery_changes_total", change="removed") == 1


async def test_a_source_started_with_known_endpoints_holds_them() -> None:
    source = Scripted(Resolved(frozenset({A})), Resolved(frozenset({A})))
    seen = [c async for c in changes(source, hold=Hold(answers=2, seconds=0.0), clock=Ticks(),
                                     known=frozenset({A, B}))]
    assert seen == [  # the first answer is yielded (the source is live); B leaves at the second
        Change("pool", frozenset({A, B}), frozenset(), frozenset()),
        Change("pool", frozenset({A}), frozenset(), frozenset({B})),
    ]


async def test_failures_before_any_answer_yield_nothing() -> None:
    registry = CollectorRegistry()
    metrics = DiscoveryMetrics(registry)
    assert sample(registry, "gateway_discovery_errors_total") is None
    assert [c async for c in changes(Scripted(Failed("refused"), Failed("refused")), metrics=metrics)] == []
    assert sample(registry, "gateway_discovery_resolutions_total") == 0  # declared at zero by changes()
    assert sample(registry, "gateway_discovery_errors_total") == 2
    assert sample(registry, "gateway_discovery_endpoints") == 0
    assert sample(registry, "gateway_discovery_endpoints_missing") == 0


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
