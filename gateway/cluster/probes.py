"""The supervisor's probes: the committed generation's backends, each on its own task, every result
sent to every worker as it comes (`state.health_feed.Finding`, with its round and epoch).

The hub keeps a backend's probe task across a reload that leaves the backend configured as it was
(same epoch: its results go on counting for the new generation too); a reload that adds or changes
a backend starts its task and waits for its first results before any worker commits, so that the
new generation starts with real health; a backend the committed config no longer has is no longer
probed, and nothing about it is sent again. What is probed changes only when a generation commits
(`adopt`), never while one is being prepared.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import aiohttp

from backends.base import Load

from ..settings import Settings
from ..state.health_feed import Finding
from ..state.pool import BackendState
from ..state.probes import Kind, ProbeTasks

log = logging.getLogger(__name__)


class SharedProbes:
    def __init__(
        self, session: aiohttp.ClientSession, *, interval_s: float, clock: Callable[[], float],
        make_states: Callable[[Settings], Iterable[BackendState]], forward: Callable[[list[list[Any]]], None],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._make_states = make_states
        self._forward = forward
        self._states: dict[str, BackendState] = {}
        self.epochs: dict[str, int] = {}
        self.round = 0
        self._latest: dict[tuple[str, str], Finding] = {}
        self._tasks = ProbeTasks(self, session, interval_s=interval_s, clock=clock, sleep=sleep,
                                 on_result=self._found)

    @property
    def followed(self) -> list[str]:
        """The backends probed now (one task each)."""
        return [s.name for s in self._tasks.followed]

    async def adopt(self, settings: Settings, epochs: Mapping[str, int]) -> None:
        """Probe the backends of a committed generation: unchanged ones as before, new and changed
        ones at once (awaited), dropped ones no more."""
        states: dict[str, BackendState] = {}
        fresh: list[BackendState] = []
        for state in self._make_states(settings):
            old = self._states.get(state.name)
            if old is not None and self.epochs.get(state.name) == epochs[state.name]:
                states[state.name] = old
            else:
                states[state.name] = state
                fresh.append(state)
        self._states, self.epochs = states, dict(epochs)
        self._tasks.interval_s = settings.health.interval_s
        self._latest = {k: f for k, f in self._latest.items() if k[1] in states and f.epoch == self.epochs[k[1]]}
        self._tasks.follow(states.values())
        await asyncio.gather(*(self._tasks.probe(s) for s in fresh))

    def snapshot(self) -> list[list[Any]]:
        """The latest finding of each kind per backend (what a worker that (re)connects adopts)."""
        return [f.wire() for f in self._latest.values()]

    async def close(self) -> None:
        await self._tasks.close()

    # -- `state.probes.Record`: the hub's own table (no requests go through it: no ejection) ------

    def record_probe(self, name: str, ok: bool, now: float, error: str | None = None) -> None:
        state = self._states.get(name)
        if state is None:
            return
        state.probe_ok = ok
        state.probed_at = now
        if not ok:
            state.last_error = error

    def record_load(self, name: str, load: Load, now: float) -> None:
        state = self._states.get(name)
        if state is not None:
            state.load = load
            state.load_scraped_at = now

    def _found(self, state: BackendState, kind: Kind) -> None:
        if self._states.get(state.name) is not state:
            return  # (a backend a commit dropped or changed meanwhile)
        self.round += 1
        found = Finding.of(state, kind, round=self.round, epoch=self.epochs[state.name])
        self._latest[(kind, state.name)] = found
        self._forward([found.wire()])
