"""Health probes and load scrapes: one task per backend, each on its own interval and timeouts.

A backend's task probes its readiness every `interval_s` (a GET bounded by the runtime's probe
timeout) and, next to it, scrapes its engine load and now and then its model card (each bounded by
its own timeout; a new scrape starts only once the previous one has finished). So a backend that
hangs delays only its own next probe, never another backend's, and every result is recorded the
moment it comes, not at the end of a round. An unexpected exception in a probe is logged with its
traceback and the task carries on.

Results go to a `Record` (a generation's pool, or the supervisor's table that it forwards to its
workers, `cluster.probes`); `on_result(state, kind)` hears each one after it was recorded. Clock and
sleep are injected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal, Protocol

import aiohttp

from backends.base import Load, LoadParseError

from .model_cards import scrape_card
from .pool import BackendState

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
Kind = Literal["ready", "load"]
LOAD_TIMEOUT_S = 5.0


class Record(Protocol):
    """Where results go (`state.pool.Pool` is one)."""

    def record_probe(self, name: str, ok: bool, now: float, error: str | None = None) -> None: ...

    def record_load(self, name: str, load: Load, now: float) -> None: ...


async def readiness(session: aiohttp.ClientSession, state: BackendState) -> tuple[bool, str | None]:
    """One readiness probe: (ok, the error when not)."""
    probe = state.adapter.readiness
    try:
        async with session.get(state.config.base_url + probe.path,
                               timeout=aiohttp.ClientTimeout(total=probe.timeout_s)) as resp:
            await resp.read()
            if resp.status in probe.ok:
                return True, None
            return False, f"readiness probe answered {resp.status}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return False, f"readiness probe failed: {type(exc).__name__}"


async def load_of(session: aiohttp.ClientSession, state: BackendState) -> Load | None:
    """The engine's load from its metrics (None: no answer, or not one we can read)."""
    config = state.config
    base = str(config.metrics_url).rstrip("/") if config.metrics_url else config.base_url
    try:
        async with session.get(base + state.adapter.load_path,
                               timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S)) as resp:
            if resp.status != 200:
                return None
            body = await resp.read()
    except (aiohttp.ClientError, TimeoutError):
        return None
    with contextlib.suppress(LoadParseError):
        return state.adapter.parse_load(body, state.load)
    return None


class ProbeTasks:
    def __init__(
        self, record: Record, session: aiohttp.ClientSession, *, interval_s: float, clock: Clock,
        sleep: Sleep = asyncio.sleep, on_result: Callable[[BackendState, Kind], None] | None = None,
    ) -> None:
        self._record = record
        self._session = session
        self.interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._on_result = on_result
        self._tasks: dict[int, tuple[BackendState, asyncio.Task[None]]] = {}  # by id(state)

    async def probe(self, state: BackendState) -> None:
        """Everything about one backend, once (at start, a reload's first look, a backend joining)."""
        await asyncio.gather(self._guarded(self._ready(state), state, "readiness probe"),
                             self._guarded(self._load(state), state, "load scrape"))

    def follow(self, states: Iterable[BackendState]) -> None:
        """Keep one task for each of `states` (the first probe comes after one interval: `probe`
        first); stop the tasks of the others."""
        wanted = {id(s): s for s in states}
        for key in [k for k in self._tasks if k not in wanted]:
            self._tasks.pop(key)[1].cancel()
        for key, state in wanted.items():
            if key not in self._tasks:
                task = asyncio.get_running_loop().create_task(self._follow(state), name=f"probe-{state.name}")
                self._tasks[key] = (state, task)

    @property
    def followed(self) -> list[BackendState]:
        return [s for s, _ in self._tasks.values()]

    async def close(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self, state: BackendState) -> None:
        side: asyncio.Task[None] | None = None
        try:
            while True:
                await self._sleep(self.interval_s)
                if side is None or side.done():
                    side = asyncio.get_running_loop().create_task(
                        self._guarded(self._load(state), state, "load scrape"), name=f"scrape-{state.name}")
                await self._guarded(self._ready(state), state, "readiness probe")
        finally:
            if side is not None:
                side.cancel()

    @staticmethod
    async def _guarded(step: Awaitable[None], state: BackendState, what: str) -> None:
        try:
            await step
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s of backend %s failed unexpectedly (its probes go on)", what, state.name)

    async def _ready(self, state: BackendState) -> None:
        ok, error = await readiness(self._session, state)
        was_healthy = state.healthy
        self._record.record_probe(state.name, ok, self._clock(), error)
        if was_healthy != state.healthy:
            log.info("backend %s is now %s", state.name, "healthy" if state.healthy else f"unhealthy ({error})")
        if self._on_result is not None:
            self._on_result(state, "ready")

    async def _load(self, state: BackendState) -> None:
        card_before = state.card_scraped_at
        load, _ = await asyncio.gather(load_of(self._session, state),
                                       scrape_card(self._session, state, self._clock()))
        if load is not None:
            self._record.record_load(state.name, load, self._clock())
        if self._on_result is not None and (load is not None or state.card_scraped_at != card_before):
            self._on_result(state, "load")
