"""Periodic readiness probes and load scrapes, one task for the whole pool.

Each round probes every backend's readiness and scrapes its load concurrently, then sleeps. The
clock and sleep are injected; a round can also be run directly (`poll_once`) by tests and at startup,
and one backend at once (`poll_backend`: a discovered backend is probed as soon as it joins). Draining
backends are not probed: they get no new requests whatever a probe says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp

from backends.base import LoadParseError

from .model_cards import scrape_card
from .pool import BackendState, Pool

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class Poller(Protocol):
    """What a config generation runs to keep its pool's health and load current: a `HealthPoller`,
    or a `health_feed.FollowedPoller` that applies the results its supervisor's poller found."""

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
    ) -> None:
        self._pool = pool
        self._session = session
        self._interval_s = interval_s
        self._clock = clock
        self._sleep = sleep

    async def poll_once(self) -> None:
        await asyncio.gather(*(self.poll_backend(s) for s in self._pool if not s.draining))

    async def run(self) -> None:
        while True:
            await self._sleep(self._interval_s)
            await self.poll_once()

    async def poll_backend(self, state: BackendState) -> None:
        """Probe one backend's readiness, scrape its load and (now and then) its model card."""
        await asyncio.gather(self._probe(state), self._scrape(state), scrape_card(self._session, state, self._clock()))

    async def _probe(self, state: BackendState) -> None:
        probe = state.adapter.readiness
        url = state.config.base_url + probe.path
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=probe.timeout_s)) as resp:
                await resp.read()
                ok = resp.status in probe.ok
                error = None if ok else f"readiness probe answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, error = False, f"readiness probe failed: {type(exc).__name__}"
        was_healthy = state.healthy
        self._pool.record_probe(state.name, ok, self._clock(), error)
        if was_healthy != state.healthy:
            log.info("backend %s is now %s", state.name, "healthy" if state.healthy else f"unhealthy ({error})")

    async def _scrape(self, state: BackendState) -> None:
        base = str(state.config.metrics_url).rstrip("/") if state.config.metrics_url else state.config.base_url
        url = base + state.adapter.load_path
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                if resp.status != 200:
                    return
                body = await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            return
        with contextlib.suppress(LoadParseError):
            self._pool.record_load(state.name, state.adapter.parse_load(body, state.load), self._clock())
