from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.discovery import DiscoveryEntry, make_source

from .harness import Dnsmasq, Follow, Follower, StepSleep
from .kube_stub import KubeStub


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp_path)
    yield server
    server.stop()


@pytest.fixture
async def follow() -> AsyncIterator[Follow]:
    """Start `changes(make_source(entry), hold=entry.hold)` with a StepSleep, a seeded rng and a
    clock (default: one that stands still)."""
    followers: list[Follower] = []

    def start(config: DiscoveryEntry, *, clock: Callable[[], float] = lambda: 100.0,
              **options: Any) -> tuple[Follower, StepSleep]:
        sleep = StepSleep()
        source = make_source(config, sleep=sleep, clock=clock, rng=random.Random(3), **options)
        followers.append(Follower(source, hold=config.hold, clock=clock))
        return followers[-1], sleep

    yield start
    for follower in followers:
        await follower.close()


@pytest.fixture
async def kube_stub() -> AsyncIterator[Callable[..., KubeStub]]:
    stubs: list[KubeStub] = []

    def make(*args: Any, **kwargs: Any) -> KubeStub:
        stubs.append(KubeStub(*args, **kwargs))
        return stubs[-1]

    yield make
    for stub in stubs:
        await stub.stop()
