"""The store that replicas share: one Redis (`state.redis_url`), through redis-py's asyncio client.

What goes through it: per-key rate limits (`access.shared_limits`: leases on each key's buckets,
settled in the background, never on a request), live A/B weights (`cluster.overrides`: a hash
polled every `sync_interval_s`, written with versions Redis issues) and every replica's window data
for the fleet comparison (`cluster.fleet`: a key per replica with a time to live). LiteLLM and
Envoy's rate-limit service keep exactly this kind of state in Redis; SGLang's gateway gossips it
instead, which needs every replica to reach every other one.

Redis is never on the critical path of correctness, and never on a request's path. Each command
has its own bound, `state.timeout_s` (the socket's read timeout: how long its answer may take);
opening a connection (TCP and redis-py's handshake) has another, `state.connect_timeout_s`, so a
store far away is not refused for the round trips of its set-up. Connections are opened when the
store comes up and pinged every `PING_EVERY_S` (warm: no command pays for a set-up), without the
client handshake's optional round trips (`CLIENT SETINFO`, maintenance notifications). Every
operation's time is observed in `gateway_state_store_seconds{use}`; a store whose pings answer, but
take more than half the command timeout, is logged as *slow* (once per episode), not as down.

A command that fails or takes longer than its bound marks the store down: from then on every user
serves on its local state (the local limiter, the last weights it knew, its own windows) without
waiting on Redis at all, the `gateway_state_store_up` gauge reads 0, and one error is logged for the
whole outage. A background probe pings with backoff (`retrying.forever`: 0.1 s doubling to 2 s,
jittered) and, once Redis answers, marks it up, logs the recovery and runs the `on_up` callbacks
(e.g. writing the weights changed during the outage). Commands are never retried by the client;
`run` raises `StoreDown` and the caller falls back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from redis import exceptions as redis_errors
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.maint_notifications import MaintNotificationsConfig

from ..merge_rules import Merge, declare
from ..retrying import Backoff, Sleep, forever
from ..settings import State

log = logging.getLogger(__name__)

T = TypeVar("T")
PING_EVERY_S = 1.0
MAX_CONNECTIONS = 16  # weights, the fleet's windows and pings; leases have a connection of their own
WARM_CONNECTIONS = 2  # pool connections opened as soon as the store is up
ROUND_TRIPS = 2  # an operation's commands (a pipeline after NOSCRIPT: two)
SLOW_FRACTION = 0.5  # a ping slower than this share of the command timeout: the store is slow
SLOW_CLEAR_S = 30.0  # an episode of slowness ends after this long without a slow command
BACKOFF_S = (0.1, 2.0)
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
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
        sleep: Sleep = asyncio.sleep, rng: random.Random | None = None,
    ) -> None:
        """`report=False`: log outages at INFO (the workers of a supervisor, whose hub reports them)."""
        self.config = config
        self._level = logging.ERROR if report else logging.INFO
        self.prefix = config.key_prefix
        self.where = describe_url(config.redis_url)
        self._clock = clock
        self._sleep = sleep
        self._backoff = Backoff(*BACKOFF_S, rng=rng)
        options: dict[str, Any] = {
            "socket_timeout": config.timeout_s, "socket_connect_timeout": config.connect_timeout_s,
            "retry": Retry(NoBackoff(), 0), "retry_on_timeout": False, "health_check_interval": 0,
            "driver_info": None, "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        }
        pool = BlockingConnectionPool.from_url(  # a few connections, waited for rather than opened in a storm
            config.redis_url, max_connections=MAX_CONNECTIONS, timeout=config.connect_timeout_s, **options)
        self.client: Redis = Redis.from_pool(pool)  # owns the pool: closing the client closes it
        # The rate limits' settles (one round in flight at a time, pipelined) on a connection of their own:
        # no pool to wait on, the cheapest path through redis-py.
        self.leases: Redis = Redis.from_url(config.redis_url, single_connection_client=True, **options)
        self.up = False
        self._down_since: float | None = clock()  # unknown until the first ping: not up
        self._reported = False  # the current outage has been logged
        self._reported_errors: set[str] = set()
        self._slow_at: float | None = None  # the last slow command of the current episode
        self.on_up: list[Callable[[], Awaitable[None]]] = []
        self._scripts: list[AsyncScript] = []
        self._probe: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.fallbacks: Counter | None = None
        self.latency: Histogram | None = None
        if registry is not None:
            registry.register(_UpGauge(self))
            self.fallbacks = Counter(
                "gateway_state_store_fallbacks", "Operations served on local state because the store was down.",
                ("use",), registry=registry,
            )
            self.latency = Histogram(
                "gateway_state_store_seconds", "Time of each operation on the shared state store (commands "
                "that failed included), by what it was for.", ("use",), buckets=LATENCY_BUCKETS, registry=registry,
            )

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def register_script(self, text: str) -> AsyncScript:
        """A Lua script its users run by sha; loaded whenever the store comes up (so that no
        operation pays the NOSCRIPT round trips after a start or a Redis restart)."""
        script = self.client.register_script(text)
        self._scripts.append(script)
        return script

    def fell_back(self, use: str) -> None:
        if self.fallbacks is not None:
            self.fallbacks.labels(use).inc()

    @property
    def _bound_s(self) -> float:
        """An operation's outer bound: a connection's set-up (when none is warm) and its commands.
        Each command is bounded by the socket's own timeout inside it."""
        return self.config.connect_timeout_s + ROUND_TRIPS * self.config.timeout_s

    async def start(self) -> None:
        """Ping once (so that users know at once whether the store is there) and keep probing."""
        await self._ping()
        if not self.up:
            self._report_down("no answer at start")
        self._probe = asyncio.get_running_loop().create_task(self._probe_loop(), name="state-store-probe")

    async def close(self) -> None:
        self.up = False  # (for its users: nothing more is sent)
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        for client in (self.leases, self.client):
            with contextlib.suppress(Exception):
                await client.aclose()

    async def run(self, op: Callable[[Redis], Awaitable[T]], *, use: str = "other") -> T:
        """`op(client)`, or StoreDown when the store is down, fails or is slower than the timeout."""
        if not self.up:
            raise StoreDown(self.where)
        started = self._clock()
        try:
            async with asyncio.timeout(self._bound_s):
                result = await op(self.client)
        except _OUTAGE as exc:
            self._observe(use, started)
            self._mark_down(exc)
            raise StoreDown(self.where) from exc
        except redis_errors.RedisError as exc:  # the store answered, but not as we expected: log once
            self._observe(use, started)
            self.refused(exc)
            raise StoreDown(self.where) from exc
        self._observe(use, started)
        return result

    def refused(self, exc: BaseException) -> None:
        """The store answered a command with an error: logged once per distinct error."""
        message = f"{type(exc).__name__}: {exc}"
        if message not in self._reported_errors:
            self._reported_errors.add(message)
            log.error("state store %s refused a command: %s", self.where, message)

    def _observe(self, use: str, started: float, *, judge: bool = False) -> None:
        """Into the histogram; `judge`: a single command on a warm connection (the probe's ping),
        which says whether the store is slow."""
        now = self._clock()
        took = now - started
        if self.latency is not None:
            self.latency.labels(use).observe(took)
        if not judge:
            return
        if took > SLOW_FRACTION * self.config.timeout_s:
            if self._slow_at is None:
                log.log(logging.WARNING if self._level == logging.ERROR else logging.INFO,
                        "state store %s is slow: a ping took %.0f ms (each command's timeout: %.0f ms); "
                        "still up and shared, but every lease renewal and weight write waits that long",
                        self.where, took * 1000, self.config.timeout_s * 1000)
            self._slow_at = now
        elif self._slow_at is not None and now - self._slow_at > SLOW_CLEAR_S:
            self._slow_at = None
            log.info("state store %s is no longer slow", self.where)

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
        """Ping on the lease connection and on the pool (which keeps them open); up once both answer."""
        started = self._clock()
        try:
            async with asyncio.timeout(self._bound_s):
                answers = await asyncio.gather(self.leases.ping(), self.client.ping(), return_exceptions=True)
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer
        except (*_OUTAGE, redis_errors.RedisError) as exc:
            self._observe("probe", started, judge=self.up)
            self._mark_down(exc)
            return False
        self._observe("probe", started, judge=self.up)  # (not a set-up's time: it has its own bound)
        if not self.up:
            await self._warm()
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

    async def _warm(self) -> None:
        """Open a few pool connections now (concurrent pings each take one) and load the scripts, so
        that the first operations do not pay for a set-up."""
        with contextlib.suppress(*_OUTAGE, redis_errors.RedisError):
            async with asyncio.timeout(self._bound_s):
                await asyncio.gather(*(self.client.ping() for _ in range(WARM_CONNECTIONS)),
                                     *(self.leases.script_load(s.script) for s in self._scripts),
                                     return_exceptions=True)

    async def _disconnect(self) -> None:
        for client in (self.client, self.leases):  # connections from before the outage are dead
            with contextlib.suppress(Exception):
                await client.connection_pool.disconnect()

    async def _probe_loop(self) -> None:
        while True:
            if self.up:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PING_EVERY_S):
                        await self._wake.wait()
                if self.up:
                    await self._ping()
                continue
            async for attempt in forever(wait=self._backoff, sleep=self._sleep, retry_on=StoreDown):
                with attempt:
                    await self._disconnect()
                    if not await self._ping():
                        raise StoreDown(self.where)


# Under `--workers N` (`gateway.merge_rules`): up only where every process reaches the store;
# fallbacks are each process's own operations.
declare(Merge.MIN, "gateway_state_store_up")
declare(Merge.SUM, "gateway_state_store_fallbacks_total", "gateway_state_store_seconds")


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
