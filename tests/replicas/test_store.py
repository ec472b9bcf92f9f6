"""The store's parts against a real Redis: atomic shared buckets leased to replicas, versioned
weights, the fleet's window data with a time to live, and the fallback to local state."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.access.leased import LeasedLimiter
from gateway.access.leases import Ask, Authority
from gateway.access.ratelimit import KeyLimiter, Limiter, Limits, LocalLimiter
from gateway.access.shared_limits import RedisSource
from gateway.cluster.fleet import FleetStats
from gateway.cluster.overrides import SharedWeights
from gateway.errors import WeightsConflict
from gateway.settings import State
from gateway.state.store import Store, StoreDown
from tests.polling import until

from .redis_server import RedisServer, free_port


async def store_for(redis: RedisServer, registry: CollectorRegistry | None = None) -> Store:
    store = Store(State(redis_url=redis.url, timeout_s=0.2), registry=registry)
    await store.start()
    return store


@pytest.fixture
async def stores(redis: RedisServer) -> AsyncIterator[list[Store]]:
    """Four clients of one Redis: four replicas as far as Redis can tell."""
    opened = [await store_for(redis) for _ in range(4)]
    yield opened
    for s in opened:
        await s.close()


def local() -> LocalLimiter:
    return LocalLimiter(KeyLimiter(time.monotonic))


OPENED: list[LeasedLimiter] = []


def leased(store: Store, fallback: Limiter | None = None, name: str = "test") -> LeasedLimiter:
    limiter = LeasedLimiter(RedisSource(store, holder=f"{name}-{id(store)}"), fallback or local(),
                            clock=time.monotonic, patience_s=store.config.timeout_s,
                            fell_back=lambda: store.fell_back("limits"))
    OPENED.append(limiter)
    return limiter


@pytest.fixture(autouse=True)
async def _close_limiters() -> AsyncIterator[None]:
    yield
    while OPENED:
        await OPENED.pop().close()


async def test_the_burst_is_the_per_minute_figure_and_then_it_says_when(stores: list[Store]) -> None:
    limiter = leased(stores[0])
    key = Limits("burst", 30, None)
    results = [await limiter.admit(key) for _ in range(31)]
    assert [r.refused for r in results[:30]] == [None] * 30
    assert [r.levels["requests"] for r in results[:3]] == pytest.approx([29, 28, 27], abs=0.01)
    assert results[30].refused == (2, "requests")  # one request refills in 2 s at 30 a minute


async def test_concurrent_replicas_cannot_overspend_a_bucket(stores: list[Store]) -> None:
    """200 admissions at once from four replicas against a burst of 50: the script runs alone."""
    limiters = [leased(s) for s in stores]
    key = Limits("race", 50, None)
    started = time.monotonic()
    results = await asyncio.gather(*(limiters[i % 4].admit(key) for i in range(200)))
    refill = (time.monotonic() - started) * 50 / 60
    granted = [r.refused for r in results].count(None)
    assert 50 <= granted <= 50 + refill + 1


async def test_the_script_promises_what_the_authority_does(stores: list[Store]) -> None:
    """Redis's Lua twin of `leases.Authority`, on the sequence where shares of stale views overspent
    (one settle by a, seven by b, a spending on its own, one holder returning): the same grants and
    promises, the same levels left (up to the refill of a few milliseconds)."""
    a, b = (RedisSource(s, holder=name) for s, name in zip(stores, "ab", strict=False))
    authority = Authority()
    steps = [(a, Ask("promise", 20, 0, want=1))] + [(b, Ask("promise", 20, 0, want=1))] * 7 + [
        (a, Ask("promise", 20, 0, spent=3)), (b, Ask("promise", 20, 0, returned=2, want=5)),
    ]
    for source, ask in steps:
        (got,) = await source.settle([ask])
        want = authority.settle(source.holder, ask, time.monotonic())
        assert (got.granted, got.promised, got.holders) == (want.granted, want.promised, want.holders)
        assert got.requests == pytest.approx(want.requests, abs=0.05)


async def test_tokens_overdraw_and_refuse_until_refilled(stores: list[Store]) -> None:
    a, b = leased(stores[0]), leased(stores[1])
    key = Limits("tokens", None, 600)
    assert (await a.admit(key)).refused is None
    a.charge(key, 1800)  # a big answer: 3 minutes' worth
    await a.flush()
    decision = await b.admit(key)
    assert decision.refused is not None
    wait, kind = decision.refused
    assert decision.levels["tokens"] == pytest.approx(-1200, abs=20)
    assert kind == "tokens"
    assert 115 <= wait <= 121  # 1,200 tokens below zero at 10 a second


async def test_a_changed_limit_rescales_the_stored_bucket(stores: list[Store]) -> None:
    """Replicas that disagree on a key's limit (a rolling deploy) share one bucket: it is rescaled to
    the same fraction full, never read as full."""
    five, six = leased(stores[0], name="five"), leased(stores[1], name="six")
    for _ in range(5):
        assert (await five.admit(Limits("changed", 5, None))).refused is None
    refused = [(await (six if i % 2 else five).admit(Limits("changed", 6 if i % 2 else 5, None))).refused
               for i in range(10)]
    assert None not in refused  # the spent bucket stays spent at either limit
    doubled = await five.admit(Limits("changed", 10, None))  # a reload raised the limit: still spent
    assert doubled.refused is not None
    assert doubled.levels["requests"] < 1


async def test_with_the_store_down_the_fallback_decides(redis: RedisServer) -> None:
    registry = CollectorRegistry()
    store = await store_for(redis, registry)
    fallback = local()
    limiter = leased(store, fallback)
    try:
        key = Limits("down", 3, 100)
        assert (await limiter.admit(key)).refused is None
        redis.stop()
        assert (await limiter.admit(key)).refused is None  # the first failure marks the store down ...
        assert store.up is False
        assert registry.get_sample_value("gateway_state_store_up") == 0
        assert (await limiter.admit(key)).refused is None  # ... and from then on nothing waits on Redis
        assert (await limiter.admit(key)).refused is None
        assert (await limiter.admit(key)).refused is not None  # the local bucket: 3 a minute
        limiter.charge(key, 50)
        assert fallback.buckets._tokens["down"].level == 50
        assert (registry.get_sample_value("gateway_state_store_fallbacks_total", {"use": "limits"}) or 0) >= 4
    finally:
        await store.close()


async def test_a_store_that_never_answers_is_down_at_once() -> None:
    store = Store(State(redis_url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.1))
    await store.start()
    try:
        assert store.up is False
        with pytest.raises(StoreDown):
            await store.run(lambda client: client.ping())
    finally:
        await store.close()


async def test_the_probe_backs_off_through_the_injected_sleep_and_finds_the_store(tmp_path: Path) -> None:
    """The reconnect loop (`retrying.forever`): jittered delays doubling from 0.1 s to 2 s, slept
    through the sleep it was given; once Redis answers, the store is up."""
    asked: list[float] = []

    async def sleep(seconds: float) -> None:
        asked.append(seconds)
        await asyncio.sleep(0.005)  # (a real pause, but not the asked one)

    late = RedisServer(tmp_path)
    store = Store(State(redis_url=late.url, timeout_s=0.1), sleep=sleep, rng=random.Random(7))
    await store.start()
    try:
        await until(lambda: len(asked) >= 8)
        assert store.up is False
        assert asked[0] <= 0.1
        assert all(b >= a * 0.8 for a, b in itertools.pairwise(asked[:5]))  # doubling, less jitter
        assert 1.6 <= max(asked) <= 2.0
        late.start()
        await until(lambda: store.up, within_s=20)
    finally:
        await store.close()
        late.stop()


async def test_weights_are_ordered_by_the_stores_versions_not_by_clocks(stores: list[Store]) -> None:
    """`a`'s clock is an hour ahead. `b` writes after reading `a`'s change: it wins. A write made on
    a version that is no longer the stored one loses, whatever its clock says, and is told so with
    the winning record; the loser then has the winner in force."""
    applied: dict[str, list[dict[str, float]]] = {"a": [], "b": [], "c": []}

    def shared(store: Store, name: str, skew_s: float = 0.0) -> SharedWeights:
        async def apply(model: str, weights: dict[str, float]) -> None:
            applied[name].append(weights)

        return SharedWeights(store, replica=name, apply=apply, fingerprints=lambda: {"ab": "f1"}, interval_s=60,
                             wall_clock=lambda: time.time() + skew_s)

    a, b = shared(stores[0], "a", skew_s=3600), shared(stores[1], "b")
    assert await a.put("ab", {"x": 1.0, "y": 9.0}, previous={"x": 5.0, "y": 5.0})
    assert await b.sync_once() == 1
    assert applied["b"] == [{"x": 1.0, "y": 9.0}]
    assert await b.put("ab", {"x": 2.0, "y": 8.0}, previous={"x": 1.0, "y": 9.0})  # later, on a's version
    assert await a.sync_once() == 1
    assert applied["a"] == [{"x": 2.0, "y": 8.0}]  # a's clock is ahead: b's change is in force anyway
    assert await b.sync_once() == 0  # its own change is not applied back to itself
    with pytest.raises(WeightsConflict) as lost:  # c has not read b's change: its write loses
        await shared(stores[2], "c").put("ab", {"x": 9.0, "y": 1.0}, previous={"x": 5.0, "y": 5.0})
    assert lost.value.record["weights"] == {"x": 2.0, "y": 8.0}
    assert lost.value.record["by"] == "b"
    assert applied["c"] == [{"x": 2.0, "y": 8.0}]  # the winner is in force on the loser
    assert await a.sync_once() == 0  # nothing was written


async def test_the_fleet_lists_live_replicas_and_forgets_silent_ones(stores: list[Store]) -> None:
    def fleet(store: Store, name: str, interval_s: float) -> FleetStats:
        async def export(max_samples: int | None) -> dict[str, object]:
            return {"version": 1, "name": name, "max_samples": max_samples}

        return FleetStats(store, replica=name, export=export, interval_s=interval_s, workers=lambda: 2)

    a, b = fleet(stores[0], "a", 10.0), fleet(stores[1], "b", 10.0)
    await a.publish_once()
    await b.publish_once()
    others = await a.others()
    assert [o["name"] for o in others] == ["b"]
    assert others[0]["max_samples"] == 16  # thinned for the trip
    assert others[0]["workers"] == 2
    ttl_ms = await stores[2].client.pttl(stores[2].key("fleet", "b"))
    assert 25_000 < ttl_ms <= 30_000  # three publishing intervals
