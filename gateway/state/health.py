"""A config generation's health and load polling: its pool's backends, each on its own probe task.

`HealthPoller` keeps one `probes.ProbeTasks` task per backend of its pool that it probes (draining
backends are not probed: they get no new requests whatever a probe says; discovered backends get a
task as they join), reconciled every interval. `poll_once` probes every backend once (at start, and
a reload's first look at its new pool), `poll_backend` one (a discovered backend is probed as soon
as it joins). Clock and sleep are injected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp

from .pool import BackendState, Pool
from .probes import ProbeTasks

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class Poller(Protocol):
    """What a config generation runs to keep its pool's health and load current: a `HealthPoller`,
    or a `health_feed.FollowedPoller` that applies the results its supervisor's probes found."""

    async def poll_once(self) -> None: ...

    async def poll_backend(self, state: BackendState) -> None: ...

    async def run(self) -> None: ...


class HealthPoller:
    def __init__(
        self,
        pool: Pool,
        session: aiohttp.ClientSession,
        *,
        interval_s: float,
        clock: Clock,
        sleep: Sleep = asyncio.sleep,
        probes: Callable[[BackendState], bool] | None = None,
    ) -> None:
        """`probes(state)`: whether this poller probes that backend (default: all of them)."""
        self._pool = pool
        self._interval_s = interval_s
        self._sleep = sleep
        self._wanted = probes
        self.tasks = ProbeTasks(pool, session, interval_s=interval_s, clock=clock, sleep=sleep)

    def _probed(self) -> list[BackendState]:
        wanted = self._wanted
        return [s for s in self._pool if not s.draining and (wanted is None or wanted(s))]

    async def poll_once(self) -> None:
        await asyncio.gather(*(self.tasks.probe(s) for s in self._probed()))

    async def poll_backend(self, state: BackendState) -> None:
        """Probe one backend's readiness, scrape its load and (now and then) its model card."""
        await self.tasks.probe(state)

    async def run(self) -> None:
        try:
            while True:
                self.tasks.follow(self._probed())
                await self._sleep(self._interval_s)
        finally:
            await self.tasks.close()
