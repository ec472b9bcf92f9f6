"""A holder's admissions while its authority is stalled (`access.leased`): the stand-ins of all holders
admit at most what the bucket had. Two `LeasedLimiter`s share one in-process `Authority` (the hub's
rule); a stalled settle is one that never answers (no network here: the hub's and Redis's are tested
in tests/integration/test_worker_limits.py and tests/replicas)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from gateway.access.leased import LeasedLimiter
from gateway.access.leases import Ask, Authority, Grant

RPM = 20


@dataclass(frozen=True)
class Key:
    id: str = "team"
    requests_per_minute: int | None = RPM
    tokens_per_minute: int | None = None


class Hub:
    """The authority, answering at once until `stall()`; then no settle ever returns."""

    def __init__(self) -> None:
        self.authority = Authority()
        self.stalled = asyncio.Event()
        self.never = asyncio.Event()

    def source(self, holder: str) -> HolderSource:
        return HolderSource(self, holder)


@dataclass
class HolderSource:
    hub: Hub
    holder: str

    def available(self) -> bool:
        return True

    async def settle(self, asks: list[Ask]) -> list[Grant]:
        if self.hub.stalled.is_set():
            await self.hub.never.wait()
        return [self.hub.authority.settle(self.holder, a, time.monotonic()) for a in asks]


@pytest.mark.parametrize("before", [
    [0, 1, 1, 1, 1, 1, 1, 1],  # worker 0's one answer is older than all of worker 1's seven
    [0, 1, 0, 1, 0, 1, 0, 1],
    [0] * 8,  # worker 1 never had an answer
])
async def test_stalled_holders_admit_at_most_the_budget_between_them(before: list[int]) -> None:
    hub = Hub()
    limiters = [LeasedLimiter(hub.source(f"w{i}"), clock=time.monotonic, patience_s=0.05) for i in range(2)]
    key = Key()
    started = time.monotonic()
    try:
        admitted = 0
        for worker in before:
            admitted += (await limiters[worker].admit(key)).refused is None
        assert admitted == 8
        hub.stalled.set()
        during = [(await limiters[i % 2].admit(key)).refused is None for i in range(40)]
    finally:
        for limiter in limiters:
            await limiter.close()
    elapsed = time.monotonic() - started
    total = admitted + sum(during)
    assert total <= RPM + elapsed * RPM / 60 + 1, (total, elapsed)  # one budget, not one per holder
    assert sum(during) >= 4  # and the holders kept admitting on their promises
