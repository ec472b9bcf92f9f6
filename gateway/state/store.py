"""The store that replicas share: one Redis (`state.redis_url`), through redis-py's asyncio client.

What goes through it: per-key rate limits (`access.shared_limits`: one atomic Lua script per
request), live A/B weights (`cluster.overrides`: a hash polled every `sync_interval_s`) and every
replica's window data for the fleet comparison (`cluster.fleet`: a key per replica with a time to
live). LiteLLM and Envoy's rate-limit service keep exactly this kind of state in Redis; SGLang's
gateway gossips it instead, which needs every replica to reach every other one.

Redis is never on the critical path of correctness. A command that fails or takes longer than
`state.timeout_s` marks the store down: from then on every user serves on its local state (the
local limiter, the last weights it knew, its own windows) without waiting on Redis at all, the
`gateway_state_store_up` gauge reads 0, and one error is logged for the whole outage. A background
probe pings with backoff (0.1 s doubling to 2 s) and, once Redis answers, marks it up, logs the
recovery and runs the `on_up` callbacks (e.g. writing the weights changed during the outage).
Commands are never retried by the client (a retry would hold a request for another timeout);
`run` raises `StoreDown` and the caller falls back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from redis import exceptions as redis_errors
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ..merge_rules import Merge, declare
from ..settings import State

log = logging.getLogger(__name__)

T = TypeVar("T")
PING_EVERY_S = 1.0
MAX_CONNECTIONS = 16  # admissions share one pipelined connection; charges, weights and the fleet a few more
BACKOFF_S = (0.1, 2.0)
_OUTAGE = (redis_errors.ConnectionError, redis_errors.TimeoutError, TimeoutError, OSError)


class StoreDown(Exception):
    """The store cannot serve this now: use local state."""


def describe_url(url: str) -> str:
    """The URL without credentials, for logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}"


class Store:
    def __init__(
        self, config: State, *, registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic, report: bool = True,
    ) -> None:
        """`report=False`: log outages at INFO (the workers of a supervisor, whose hub reports them)."""
        self.config = config
        self._level = logging.ERROR if report else logging.INFO
        self.prefix = config.key_prefix
        self.where = describe_url(config.redis_url)
        self._clock = clock
        pool = BlockingConnectionPool.from_url(  # a few connections, waited for rather than opened in a storm
            config.redis_url, max_connections=MAX_CONNECTIONS, timeout=config.timeout_s,
            socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0,
        )
        self.client: Redis = Redis.from_pool(pool)  # owns the pool: closing the client closes it
        # The rate limiter's pipelined admissions (one round trip in flight at a time) on a connection of
        # their own: no pool to wait on, the cheapest path through redis-py (~100 µs of CPU a call here).
        self.admissions: Redis = Redis.from_url(
            config.redis_url, single_connection_client=True, socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s, retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
            health_check_interval=0,
        )
        self.up = False
        self._down_since: float | None = clock()  # unknown until the first ping: not up
        self._reported = False  # the current outage has been logged
        self._reported_errors: set[str] = set()
        self.on_up: list[Callable[[], Awaitable[None]]] = []
        self._probe: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.fallbacks: Counter | None = None
        if registry is not None:
            registry.register(_UpGauge(self))
            self.fallbacks = Counter(
                "gateway_state_store_fallbacks", "Operations served on local state because the store was down.",
                ("use",), registry=registry,
            )

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def fell_back(self, use: str) -> None:
        if self.fallbacks is not None:
            self.fallbacks.labels(use).inc()

    async def start(self) -> None:
        """Ping once (so that users know at once whether the store is there) and keep probing."""
        await self._ping()
        if not self.up:
            self._report_down("no answer at start")
        self._probe = asyncio.get_running_loop().create_task(self._probe_loop(), name="state-store-probe")

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        for client in (self.admissions, self.client):
            with contextlib.suppress(Exception):
                await client.aclose()

    async def run(self, op: Callable[[Redis], Awaitable[T]]) -> T:
        """`op(client)`, or StoreDown when the store is down, fails or is slower than the timeout."""
        if not self.up:
            raise StoreDown(self.where)
        try:
            async with asyncio.timeout(self.config.timeout_s * 2):  # a pipeline may take two round trips
                return await op(self.client)
        except _OUTAGE as exc:
            self._mark_down(exc)
            raise StoreDown(self.where) from exc
        except redis_errors.RedisError as exc:  # the store answered, but not as we expected: log once
            message = f"{type(exc).__name__}: {exc}"
            if message not in self._reported_errors:
                self._reported_errors.add(message)
                log.error("state store %s refused a command: %s", self.where, message)
            raise StoreDown(self.where) from exc

    def _mark_down(self, exc: BaseException | str) -> None:
        if not self.up:
            return
        self.up = False
        self._down_since = self._clock()
        self._report_down(exc)
        self._wake.set()

    def _report_down(self, why: BaseException | str) -> None:
        if self._reported:
            return
        self._reported = True
        reason = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
        log.log(self._level, "state store %s is unreachable (%s): serving on local state (local limits, last "
                "known weights, this replica's windows) until it is back", self.where, reason)

    async def _ping(self) -> bool:
        try:
            async with asyncio.timeout(self.config.timeout_s * 2):
                await self.client.ping()
        except (*_OUTAGE, redis_errors.RedisError) as exc:
            self._mark_down(exc)
            return False
        if not self.up:
            outage = self._clock() - self._down_since if self._down_since is not None else 0.0
            if self._reported:
                log.log(logging.WARNING if self._level == logging.ERROR else logging.INFO,
                        "state store %s is reachable again after %.1f s: sharing state again", self.where, outage)
            else:
                log.info("state store %s is reachable", self.where)
            self.up = True
            self._reported = False
            self._down_since = None
            for callback in self.on_up:
                try:
                    await callback()
                except StoreDown:
                    break
                except Exception:
                    log.exception("state store: a reconnect callback failed")
        return True

    async def _probe_loop(self) -> None:
        delay = BACKOFF_S[0]
        while True:
            if self.up:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PING_EVERY_S):
                        await self._wake.wait()
                if self.up:
                    await self._ping()
                delay = BACKOFF_S[0]
                continue
            for client in (self.client, self.admissions):  # connections from before the outage are dead
                with contextlib.suppress(Exception):
                    await client.connection_pool.disconnect()
            await asyncio.sleep(delay)
            if not await self._ping():
                delay = min(delay * 2, BACKOFF_S[1])


# Under `--workers N` (`gateway.merge_rules`): up only where every process reaches the store;
# fallbacks are each process's own operations.
declare(Merge.MIN, "gateway_state_store_up")
declare(Merge.SUM, "gateway_state_store_fallbacks_total")


class _UpGauge:
    def __init__(self, store: Store) -> None:
        self._store = store

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "gateway_state_store_up", "1 while the shared state store (state.redis_url) answers, else 0.")
        family.add_metric([], 1.0 if self._store.up else 0.0)
        yield family
