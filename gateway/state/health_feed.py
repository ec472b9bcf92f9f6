"""Probe results that one prober takes and many pools apply: health probed once per gateway.

With `--workers N` only the supervisor probes the configured backends (SGLang's `/health` runs a
generation: N workers probing would be N generations per interval per backend). It sends every
worker each result as it comes (`Finding`), each worker's `ProbeFeed` keeps the latest per backend,
and the pools of its config generations follow it (`FollowedPoller`, in place of their own poller):
a probe marks a backend up or down, re-admits an ejected one once its cool-down is over, and sets
its engine load, exactly as if the worker had probed it itself, on the worker's own clock. Outlier
ejection stays per worker (it judges the requests that worker sent). A discovered backend (discovery
runs in every worker) is probed by the worker itself (`probed_by_worker`).

A result is applied once, when it arrives, and only where it is true:

- `round` orders results: the feed drops one that is not newer than what it has for that backend;
- `epoch` is the config generation since which the supervisor probes the backend as it is
  configured now (a backend whose URL, runtime ... a reload changed starts a new epoch). Each
  generation's pool takes only results of its own epoch for each backend (`epochs`, handed out with
  the committed generation), so a result about a backend's old address never reaches its new one,
  and a backend the committed config no longer has gets nothing at all: nothing is re-applied.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from backends.base import Load

from .health import Poller
from .pool import STATIC, BackendState, Pool
from .probes import Kind

_LOAD_FIELDS = {f.name for f in dataclasses.fields(Load)}


@dataclass(frozen=True, slots=True)
class Finding:
    """One result of the supervisor's probes: readiness (`ok`, `error`) or load (`load`, `max_model_len`)."""

    kind: Kind
    backend: str
    round: int  # the supervisor's count of results: a later result has a higher round
    epoch: int  # the generation since which this backend is probed as configured now
    ok: bool = False
    error: str | None = None
    load: Load | None = None
    max_model_len: int | None = None

    @classmethod
    def of(cls, state: BackendState, kind: Kind, *, round: int, epoch: int) -> Finding:
        if kind == "ready":
            return cls(kind, state.name, round, epoch, ok=state.probe_ok,
                       error=None if state.probe_ok else state.last_error)
        return cls(kind, state.name, round, epoch, load=state.load if state.load_scraped_at is not None else None,
                   max_model_len=state.max_model_len)

    def wire(self) -> list[Any]:
        """Plain data, for the channel."""
        if self.kind == "ready":
            return ["ready", self.backend, self.round, self.epoch, self.ok, self.error]
        return ["load", self.backend, self.round, self.epoch,
                None if self.load is None else dataclasses.asdict(self.load), self.max_model_len]

    @classmethod
    def from_wire(cls, row: list[Any]) -> Finding:
        kind, backend, round_, epoch, a, b = row
        if kind == "ready":
            return cls("ready", str(backend), int(round_), int(epoch), ok=bool(a), error=None if b is None else str(b))
        load = None if a is None else _load(a)
        return cls("load", str(backend), int(round_), int(epoch), load=load,
                   max_model_len=None if b is None else int(b))


def _load(plain: dict[str, Any]) -> Load:
    """A `Load` from its wire form (`dataclasses.asdict`: its data-parallel ranks' loads nested)."""
    fields = {k: v for k, v in plain.items() if k in _LOAD_FIELDS}
    ranks = fields.pop("per_rank", None) or ()
    return Load(**fields, per_rank=tuple(_load(r) for r in ranks))


def apply(pool: Pool, found: Finding, now: float) -> None:
    """Record one finding in `pool`, as if this process had probed the backend itself."""
    if found.kind == "ready":
        pool.record_probe(found.backend, found.ok, now, found.error)
        return
    if found.load is not None:
        pool.record_load(found.backend, found.load, now)
    if found.max_model_len is not None:
        with contextlib.suppress(KeyError):  # (a backend this generation does not have)
            pool[found.backend].max_model_len = found.max_model_len


def probed_by_worker(state: BackendState) -> bool:
    """A worker probes only what its own discovery found; its supervisor probes the configured ones."""
    return state.source != STATIC


class ProbeFeed:
    """The latest finding of each kind per backend, and the pools that follow them."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, str], Finding] = {}  # (kind, backend) -> finding
        self._followers: list[FollowedPoller] = []

    def publish(self, rows: Iterable[list[Any]]) -> None:
        """Findings as they come (the supervisor's notifications, or its snapshot at hello/state)."""
        for row in rows:
            found = Finding.from_wire(row)
            key = (found.kind, found.backend)
            known = self._latest.get(key)
            if known is not None and known.round >= found.round:
                continue  # stale: a newer result is already here
            self._latest[key] = found
            for follower in list(self._followers):
                follower.take(found)

    def latest(self, backend: str) -> list[Finding]:
        return [f for f in (self._latest.get(("ready", backend)), self._latest.get(("load", backend)))
                if f is not None]

    def retain(self, backends: Collection[str]) -> None:
        """A generation was committed: forget the backends it does not have."""
        self._latest = {k: f for k, f in self._latest.items() if k[1] in backends}

    def follow(self, follower: FollowedPoller) -> None:
        self._followers.append(follower)

    def unfollow(self, follower: FollowedPoller) -> None:
        if follower in self._followers:
            self._followers.remove(follower)


class FollowedPoller:
    """A config generation's poller that applies the findings of the supervisor's probes (those of
    the epochs its generation was committed with); `own` probes what the worker discovered itself."""

    def __init__(self, pool: Pool, feed: ProbeFeed, clock: Callable[[], float], own: Poller,
                 epochs: Mapping[str, int]) -> None:
        self._pool = pool
        self._feed = feed
        self._clock = clock
        self._own = own
        self.epochs = dict(epochs)  # backend -> the epoch whose findings this pool takes

    def take(self, found: Finding) -> None:
        if self.epochs.get(found.backend) == found.epoch:
            apply(self._pool, found, self._clock())

    async def poll_once(self) -> None:
        for name in self.epochs:
            for found in self._feed.latest(name):
                self.take(found)
        await self._own.poll_once()

    async def poll_backend(self, state: BackendState) -> None:
        if state.name in self.epochs:
            for found in self._feed.latest(state.name):
                self.take(found)
        else:
            await self._own.poll_backend(state)

    async def run(self) -> None:
        self._feed.follow(self)
        try:
            await self._own.run()
        finally:
            self._feed.unfollow(self)
