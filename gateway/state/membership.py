"""Discovered backends joining and leaving the running pool, without a restart or a reload.

One task per `discovery:` entry follows its source (`gateway.discovery.changes`) and applies every
change of its endpoint set to the pools that serve requests. What is guaranteed:

- A backend that joins is added not ready (`probe_ok` false) and probed at once: it gets requests
  only after a passing readiness probe, then in every route and A/B arm that names its discovery
  pool. It gets its runtime, model, price and credentials from the entry.
- A backend that leaves is drained: it is out of every route at once (no new requests, retries
  included), the requests in flight on it finish, and once none is (checked every
  `health.interval_s`; at the latest after `timeouts.total_s`, by when every request has ended) it
  is removed from the pool. One that comes back while draining is taken back (not routable until
  its next passing probe). "Leaves" is the source's set in force: a DNS entry holds an address its
  answers leave out until it has been missing long enough (`discovery.hysteresis`).
- A backend that left is remembered for its entry's `remember_s` from the moment it started to
  drain (`remembered()`): the composition root keeps its live-comparison history and routing
  memory (prefix memory, learned rates) meanwhile, and a backend that comes back gets them back
  (a pod that flapped Ready, an address that was missing longer than the hold). Then they are
  forgotten; so are the oldest beyond `REMEMBERED_MAX` per entry.
- A source that fails keeps its last known backends (the sources guarantee it; nothing here
  changes on a failure).
- Membership belongs to the app, not to a config generation: each generation's pool is built from
  the static backends plus the current discovered sets (`discovered()`), so a reload keeps them,
  and a change that lands while a reload is being probed reaches the new pool too. A reload that
  changes an entry's source (`dns:` or `kubernetes:`) restarts that source; its last set stays in
  force until the new source's first answer, which then joins and drains by difference. A reload
  that changes only what the entry's backends are (runtime, model, price, ...) keeps the set and
  remakes the backends. An entry that a reload removes stops, and its backends leave with the old
  generation.

Time and sleep come from the composition root (`gateway/app.py`), which also says how a backend
state is made (adapters and credentials belong to the access room, above this one).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ..discovery import DiscoveryEntry, DiscoveryMetrics, Endpoint, Source, backends_of, changes
from ..settings import Backend, Settings
from .generations import Generation, Generations
from .pool import BackendState

log = logging.getLogger(__name__)

REMEMBERED_MAX = 64  # backends that left, remembered per entry (the oldest are forgotten first)

MakeState = Callable[[Backend, str, Generation], BackendState]  # (config, entry name, generation)
MakeSource = Callable[[DiscoveryEntry], Source]
Changed = Callable[[Generation], None]  # the newest generation's pool gained or lost a backend


@dataclass(eq=False)
class _Followed:
    """One entry: its config, the endpoints it has now and the backends they make."""

    entry: DiscoveryEntry
    endpoints: frozenset[Endpoint] = frozenset()
    backends: dict[str, Backend] = field(default_factory=dict)  # by name, in endpoint order
    task: asyncio.Task[None] | None = None


def make_backends(entry: DiscoveryEntry, endpoints: frozenset[Endpoint]) -> dict[str, Backend]:
    """The backends `entry` makes of `endpoints`; an endpoint that makes no valid backend (an
    address no URL can hold) is left out and logged."""
    made: dict[str, Backend] = {}
    for found in backends_of(entry, endpoints):
        try:
            made[found.name] = Backend.model_validate(found.settings())
        except ValidationError as exc:
            log.warning("discovery %s: endpoint %s left out: %s", entry.name, found.endpoint.authority,
                        exc.errors()[0]["msg"])
    return made


class Membership:
    """The discovered part of the pool: which backends each entry has now, and their comings and goings."""

    def __init__(
        self,
        generations: Generations,
        *,
        make_state: MakeState,
        make_source: MakeSource,
        metrics: DiscoveryMetrics | None,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
        on_change: Changed,
    ) -> None:
        self._generations = generations
        self._make_state = make_state
        self._make_source = make_source
        self._metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self._on_change = on_change
        self._followed: dict[str, _Followed] = {}
        self._left: dict[str, tuple[str, float]] = {}  # backend -> (its entry, when it started to drain)
        self._newest: Generation | None = None
        self._running = False
        self._tasks: set[asyncio.Task[None]] = set()  # probes, the reaper, sources being stopped
        self._reaper: asyncio.Task[None] | None = None

    # -- config generations ---------------------------------------------------------------------

    def configure(self, settings: Settings) -> None:
        """Adopt a (re)loaded config's entries (see the module docstring); call before building
        its generation's pool from `discovered()`."""
        entries = {e.name: e for e in settings.discovery}
        if any(e.kubernetes is not None for e in entries.values()):
            # kubernetes_asyncio takes seconds to import: at start, before the gateway listens,
            # rather than in the first source's task on the serving loop.
            importlib.import_module("gateway.discovery.kubernetes")
        for name in [n for n in self._followed if n not in entries]:
            self._stop_following(self._followed.pop(name))
            log.info("discovery %s: removed from the config, stopped", name)
        self._left = {b: (e, at) for b, (e, at) in self._left.items() if e in entries}
        for name, entry in entries.items():
            followed = self._followed.get(name)
            if followed is None:
                self._follow(_Followed(entry))
            elif (entry.dns, entry.kubernetes) != (followed.entry.dns, followed.entry.kubernetes):
                self._stop_following(followed)
                log.info("discovery %s: its source changed, restarted (the last %d endpoint(s) stay until it "
                         "answers)", name, len(followed.endpoints))
                self._follow(_Followed(entry, followed.endpoints, make_backends(entry, followed.endpoints)))
            elif entry != followed.entry:
                followed.entry = entry
                followed.backends = make_backends(entry, followed.endpoints)

    def discovered(self, settings: Settings | None = None) -> list[tuple[Backend, str]]:
        """Every discovered backend now, with the entry it came from: what a new pool starts with.
        With `settings` (a generation being prepared, not committed): what `configure(settings)`
        would leave, changing nothing."""
        if settings is None:
            return [(b, name) for name, f in self._followed.items() for b in f.backends.values()]
        found: list[tuple[Backend, str]] = []
        for entry in settings.discovery:
            followed = self._followed.get(entry.name)
            if followed is not None:
                made = followed.backends if entry == followed.entry else make_backends(entry, followed.endpoints)
                found += [(b, entry.name) for b in made.values()]
        return found

    def remembered(self) -> set[str]:
        """Backends that left lately (within their entry's `remember_s`): their history and routing
        memory wait for their return."""
        now = self._clock()
        return {b for b, (entry, at) in self._left.items()
                if (f := self._followed.get(entry)) is not None and now - at < f.entry.remember_s}

    def adopt(self, generation: Generation) -> None:
        """`generation` was just built from `discovered()` (it may not be installed yet)."""
        self._newest = generation

    @property
    def newest(self) -> Generation | None:
        """The generation built last: current, or being probed before a reload installs it."""
        return self._newest

    # -- lifetime -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start following every entry, and the reaper of drained backends (on the serving loop)."""
        self._running = True
        for followed in self._followed.values():
            self._start(followed)
        self._reaper = asyncio.create_task(self._reap_forever(), name="discovery-reaper")

    async def stop(self) -> None:
        self._running = False
        tasks = [*self._tasks, *(f.task for f in self._followed.values() if f.task is not None)]
        if self._reaper is not None:
            tasks.append(self._reaper)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for followed in self._followed.values():
            followed.task = None
        self._reaper = None

    def _follow(self, followed: _Followed) -> None:
        self._followed[followed.entry.name] = followed
        if self._running:
            self._start(followed)

    def _start(self, followed: _Followed) -> None:
        task = asyncio.create_task(self._run(followed), name=f"discovery-{followed.entry.name}")
        task.add_done_callback(self._ended)
        followed.task = task

    def _stop_following(self, followed: _Followed) -> None:
        if followed.task is not None:
            followed.task.cancel()
            self._spawn_done(followed.task)
            followed.task = None

    def _spawn_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._spawn_done(asyncio.create_task(coro, name=name))

    @staticmethod
    def _ended(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:  # a source never ends: a bug
            log.error("%s ended: %r (its last backends stay)", task.get_name(), task.exception())

    async def _run(self, followed: _Followed) -> None:
        entry = followed.entry  # a restarted source starts from the set in force (its hold counts from now)
        async for change in changes(self._make_source(entry), metrics=self._metrics, hold=entry.hold,
                                    clock=self._clock, known=followed.endpoints):
            try:
                self.apply(followed.entry.name, change.endpoints)
            except Exception:  # one bad change must not stop following the source
                log.exception("discovery %s: could not apply a change", followed.entry.name)

    # -- changes --------------------------------------------------------------------------------

    def apply(self, name: str, endpoints: frozenset[Endpoint]) -> None:
        """Entry `name` has `endpoints` now: new backends join (not ready, probed at once), gone ones drain."""
        followed = self._followed.get(name)
        if followed is None:
            return
        before = followed.backends
        after = make_backends(followed.entry, endpoints)
        followed.endpoints, followed.backends = endpoints, after
        joined = [b for n, b in after.items() if n not in before]
        left = [n for n in before if n not in after]
        if not joined and not left:
            return
        now = self._clock()
        self._remember(name, left, now)
        for config in joined:
            self._left.pop(config.name, None)
        newest = self._newest
        for generation in self._live():
            pool = generation.pool
            for gone in left:
                if pool.drain(gone, now) is not None and generation is newest:
                    log.info("discovery %s: backend %s draining (%d in flight)", name, gone, pool[gone].in_flight)
            if generation is not newest and generation.retired:
                continue  # a retired generation only finishes its requests: no newcomers
            for config in joined:
                state = pool.join(self._make_state(config, name, generation))
                if state is None:
                    if generation is newest:
                        log.warning("discovery %s: backend name %s is taken; endpoint left out", name, config.name)
                    continue
                self._spawn(generation.poller.poll_backend(state), name=f"probe-{state.name}")
        if newest is not None:
            log.info("discovery %s: %s joined, %s draining", name, [b.name for b in joined] or "none", left or "none")
            self._on_change(newest)

    def _remember(self, entry: str, left: list[str], now: float) -> None:
        followed = self._followed[entry]
        if followed.entry.remember_s <= 0:
            return
        for name in left:
            self._left.pop(name, None)  # to the end: the newest
            self._left[name] = (entry, now)
        mine = [b for b, (e, _) in self._left.items() if e == entry]  # oldest first (insertion order)
        for name in mine[:max(0, len(mine) - REMEMBERED_MAX)]:
            del self._left[name]

    def forget_expired(self) -> None:
        """Backends remembered past their entry's `remember_s` are forgotten (the composition root
        drops their history and routing memory)."""
        remembered = self.remembered()
        expired = [b for b in self._left if b not in remembered]
        for name in expired:
            del self._left[name]
        if expired and self._newest is not None:
            log.info("discovery: forgot %d backend(s) that left more than remember_s ago", len(expired))
            self._on_change(self._newest)

    def _live(self) -> list[Generation]:
        """The newest generation, the current one and the retired ones still finishing requests."""
        found: list[Generation] = []
        for generation in (self._newest, self._generations.current, *self._generations.retired):
            if generation is not None and all(generation is not g for g in found):
                found.append(generation)
        return found

    # -- drained backends leave -----------------------------------------------------------------

    def reap(self) -> None:
        """Remove draining backends with nothing in flight (or that overran `timeouts.total_s`)."""
        now = self._clock()
        removed = False
        for generation in self._live():
            if generation.retired:
                continue  # dropped whole once its last request leaves
            pool = generation.pool
            limit = generation.settings.timeouts.total_s
            for state in [s for s in pool if s.draining]:
                overdue = state.draining_since is not None and now - state.draining_since >= limit
                if state.in_flight > 0 and not overdue:
                    continue
                pool.remove(state.name)
                removed = True
                if generation is self._newest:
                    log.info("discovery %s: backend %s left the pool%s", state.source, state.name,
                             f" with {state.in_flight} request(s) still running" if state.in_flight else "")
        if removed and self._newest is not None:
            self._on_change(self._newest)

    async def _reap_forever(self) -> None:
        while True:
            newest = self._newest
            await self._sleep(newest.settings.health.interval_s if newest is not None else 1.0)
            try:
                self.reap()
                self.forget_expired()
            except Exception:
                log.exception("discovery: reaping drained backends failed")
