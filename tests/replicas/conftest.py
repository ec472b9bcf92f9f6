"""The replicas tier: a real Redis and several real `gateway serve` processes sharing it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import pytest

from tests.integration.fixtures import emulators, loop_thread
from tests.integration.harness import GatewayProcess

from .redis_server import RedisServer, available

__all__ = ["emulators", "loop_thread"]


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    if not available():
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; `make system-deps`)")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


Replicas = Callable[..., list[GatewayProcess]]


class Store(Protocol):
    """Where replicas find their Redis: a `RedisServer`, or a `LatencyProxy` in front of one."""

    @property
    def url(self) -> str: ...


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Replicas]:
    """`replicas(config, n, workers=1, **state)`: n gateways of one config (each its own replica_id),
    started at once; all stopped at the end."""
    started: list[GatewayProcess] = []

    def start(config: dict[str, Any], n: int, *, workers: int = 1, redis: Store | None = None,
              **state: Any) -> list[GatewayProcess]:
        def one(i: int) -> GatewayProcess:
            cfg = dict(config)
            if redis is not None:
                cfg["state"] = {"redis_url": redis.url, "replica_id": f"replica-{len(started) + i}", **state}
            workdir = tmp_path / f"replica-{len(started) + i}"
            workdir.mkdir()
            return GatewayProcess(cfg, workdir, workers=workers)

        with ThreadPoolExecutor(n) as pool:
            gateways = list(pool.map(one, range(n)))
        started.extend(gateways)
        return gateways

    yield start
    for gw in started:
        gw.stop()
