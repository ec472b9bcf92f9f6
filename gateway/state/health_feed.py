"""Probe results that one poller takes and many pools apply: health probed once per gateway.

With `--workers N` only the supervisor runs a `HealthPoller` (SGLang's `/health` runs a generation:
N workers probing would be N generations per interval per backend). After each round it sends every
worker the results (`results`), each worker's `ProbeFeed` keeps the latest per backend, and the
pools of its config generations follow it (`FollowedPoller`, in place of their own poller): a probe
marks a backend up or down, re-admits an ejected one once its cool-down is over, and sets its engine
load, exactly as if the worker had probed it itself, on the worker's own clock. Outlier ejection
stays per worker (it judges the requests that worker sent). A backend the supervisor does not probe
(one that this worker's discovery found: discovery runs in every worker) is probed by the worker
itself, on the supervisor's rounds.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from backends.base import Load

from .health import Poller
from .pool import BackendState, Pool

Result = list[Any]  # [backend, probe ok, error or None, load as a dict]


def results(pool: Pool) -> list[Result]:
    """What the last round found, per backend of `pool` (plain data, for the channel)."""
    return [[s.name, s.probe_ok, s.last_error, dataclasses.asdict(s.load)] for s in pool if s.probed_at is not None]


class ProbeFeed:
    """The latest result per backend name, and a way to wait for the next round."""

    def __init__(self) -> None:
        self.latest: dict[str, Result] = {}
        self.rounds = 0
        self._changed = asyncio.Event()

    def publish(self, round_results: Iterable[Result]) -> None:
        for r in round_results:
            self.latest[str(r[0])] = r
        self.rounds += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def next_round(self, seen: int) -> int:
        """Wait until a round newer than `seen` has arrived; its number."""
        while self.rounds <= seen:
            await self._changed.wait()
        return self.rounds


_LOAD_FIELDS = {f.name for f in dataclasses.fields(Load)}


def apply(pool: Pool, found: Iterable[Result], now: float) -> None:
    names = {s.name for s in pool}
    for name, ok, error, load in found:
        if name not in names:
            continue  # a backend this config generation does not have
        pool.record_probe(name, bool(ok), now, error)
        pool.record_load(name, Load(**{k: v for k, v in load.items() if k in _LOAD_FIELDS}), now)


class FollowedPoller:
    """A config generation's poller that applies what the feed receives; `own` probes only the
    backends the feed says nothing about."""

    def __init__(self, pool: Pool, feed: ProbeFeed, clock: Callable[[], float], own: Poller) -> None:
        self._pool = pool
        self._feed = feed
        self._clock = clock
        self._own = own

    async def poll_once(self) -> None:
        apply(self._pool, self._feed.latest.values(), self._clock())
        unknown = [s for s in self._pool if s.name not in self._feed.latest and not s.draining]
        if unknown:
            await asyncio.gather(*(self._own.poll_backend(s) for s in unknown))

    async def poll_backend(self, state: BackendState) -> None:
        found = self._feed.latest.get(state.name)
        if found is None:
            await self._own.poll_backend(state)
        else:
            apply(self._pool, [found], self._clock())

    async def run(self) -> None:
        seen = self._feed.rounds
        while True:
            seen = await self._feed.next_round(seen)
            await self.poll_once()
