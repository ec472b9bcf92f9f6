"""Config generations: what a reload swaps atomically.

A generation is everything built from one config: settings, resolved secrets, the pool, the service
that serves its requests and its health poller. The composition root (`gateway/app.py`) builds the
parts and hands them in: this room knows the service only as something to close (`Service`; it is
the proxy room's `Proxy`, which `proxy.service.proxy_of` gives back typed), so nothing here imports
upwards. Handlers `enter()` the current generation when a request arrives and `leave()` it
when the request (stream included) is finished, so a request runs on the config it started with. A
retired generation's poller stops once its last request has left. The metrics registry, recorder,
statistics and HTTP session belong to the app and outlive every generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from ..access.secrets import Secrets
from ..settings import Settings
from .health import Poller
from .pool import BackendState, Pool


class Service(Protocol):
    """What a generation serves requests with, as far as its lifetime goes."""

    async def close(self) -> None: ...


@dataclass(eq=False, slots=True)
class Generation:
    number: int
    settings: Settings
    secrets: Secrets
    pool: Pool
    proxy: Service
    poller: Poller
    task: asyncio.Task[None] | None = None
    in_flight: int = 0
    retired: bool = False

    def start(self) -> None:
        self.task = asyncio.create_task(self.poller.run(), name=f"health-poller-{self.number}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None
        await self.proxy.close()  # shadow requests still running are cancelled


class Generations:
    """Holds the current generation; swapping it is one assignment on the event loop (atomic)."""

    def __init__(self) -> None:
        self._current: Generation | None = None
        self.retired: list[Generation] = []

    @property
    def current(self) -> Generation:
        assert self._current is not None, "no generation installed yet"
        return self._current

    def install(self, generation: Generation) -> Generation | None:
        """Make `generation` current; the previous one is retired (its poller stops once drained)."""
        old, self._current = self._current, generation
        if old is not None:
            old.retired = True
            if old.in_flight == 0:
                self._stop_later(old)
            else:
                self.retired.append(old)
        return old

    def enter(self) -> Generation:
        generation = self.current
        generation.in_flight += 1
        return generation

    def leave(self, generation: Generation) -> None:
        generation.in_flight -= 1
        if generation.retired and generation.in_flight == 0 and generation in self.retired:
            self.retired.remove(generation)
            self._stop_later(generation)

    @staticmethod
    def _stop_later(generation: Generation) -> None:
        if generation.task is not None:
            generation.task.cancel()
            generation.task = None


class LivePool(Pool):
    """The current generation's pool, for the Prometheus collector registered once at start-up."""

    def __init__(self, generations: Generations) -> None:  # deliberately no Pool.__init__: a view
        self._generations = generations

    def __iter__(self) -> Iterator[BackendState]:
        return iter(self._generations.current.pool)
