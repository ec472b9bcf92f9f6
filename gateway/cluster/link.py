"""A worker's side of its supervisor's channel (see `hub` for what goes through it).

The worker connects before it builds anything: its first config generation is the hub's committed
one (never the file on disk), with the latest probe results and the weights set at run time, so a
worker that replaces a crashed one serves what its siblings serve, with the gateway's state, from
its first request. What the hub asks of a worker: its metric families (`collect`), its windows
(`stats`), to apply weights (`apply_weights`), to prepare, commit or abort a reload (`following`),
who it is (`identity`); and it tells it each probe result as it comes (`probes`). What the worker
asks of the hub: to settle its leases on the host's rate-limit buckets (`HubSource`: in the
background, never on a request), and everything an admin surface does (`Remote`).
When the channel closes (the supervisor is gone) the worker drains and exits: no orphans.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from ..access.leased import LeasedLimiter, SourceDown
from ..access.leases import Ask, Grant
from ..errors import WeightsConflict
from ..proxy.service import proxy_of
from ..state.generations import Generations
from ..state.health import Poller
from ..state.health_feed import FollowedPoller, ProbeFeed
from ..state.pool import Pool
from ..state.reload import Checked, Reloaded, Reloader, ReloadRejected
from ..stats import StatsBook
from ..stats.export import export_book
from .channel import Channel, ChannelClosed, Handler, RemoteError
from .committed import Received
from .following import Following
from .scrape import dump

# How long an admission waits for the hub (a key's first request here), and how long a settle may be
# under way before this worker decides on its share alone: the hub's loop is shared with probe
# rounds and merges, and a stall of it must not hold up requests.
HUB_PATIENCE_S = 0.2
SETTLE_TIMEOUT_S = 30.0  # a late answer still counts (its units were taken from the host's buckets)


class HubSource:
    """The host's buckets in the hub (`hub_limits`), as a lease source."""

    def __init__(self, channel: Channel, holder: str) -> None:
        self._channel = channel
        self.holder = holder

    def available(self) -> bool:
        return not self._channel.closed.is_set()

    async def settle(self, asks: list[Ask]) -> list[Grant]:
        try:
            raw = await self._channel.call("settle", [self.holder, [a.encode() for a in asks]],
                                           timeout_s=SETTLE_TIMEOUT_S)
        except (ChannelClosed, RemoteError, TimeoutError) as exc:
            raise SourceDown(f"the supervisor: {type(exc).__name__}") from exc
        return [Grant.decode(g) for g in raw]


@dataclass
class WorkerParts:
    """What the hub reaches in a built worker."""

    registry: CollectorRegistry
    book: StatsBook
    generations: Generations
    reloader: Reloader
    clock: Callable[[], float]
    served: Callable[[], float]


class WorkerLink:
    def __init__(self, channel: Channel, slot: int, task: asyncio.Task[None], state: dict[str, Any],
                 directory: Path | None = None) -> None:
        self.channel = channel
        self.slot = slot
        self.directory = directory  # the supervisor's private directory (its KV event relays, `kvcache.relay`)
        self._task = task
        self.feed = ProbeFeed()
        self.feed.publish(state.get("probes", []))
        self.following = Following(Received.from_wire(state["committed"]), self.feed)
        self.overrides: dict[str, dict[str, float]] = state.get("overrides", {})
        self.parts: WorkerParts | None = None
        channel.handle("probes", self.feed.publish)

    @property
    def closed(self) -> asyncio.Event:
        return self.channel.closed

    @classmethod
    async def connect(cls, path: str | Path, slot: int) -> WorkerLink:
        reader, writer = await asyncio.open_unix_connection(str(path))
        channel = Channel(reader, writer, {}, name=f"worker-{slot}->hub")
        task = asyncio.get_running_loop().create_task(channel.run(), name="hub-channel")
        state = await channel.call("hello", {"slot": slot, "pid": os.getpid()})
        return cls(channel, slot, task, state, Path(path).parent)

    def limiter(self, clock: Callable[[], float]) -> LeasedLimiter:
        """This worker's admissions, from leases on the host's buckets; on its share of each key's
        budget while the hub is stalled or gone."""
        return LeasedLimiter(HubSource(self.channel, f"worker-{self.slot}"), clock=clock, patience_s=HUB_PATIENCE_S)

    @property
    def generation(self) -> int:
        """The number of the committed generation this worker runs (or is building)."""
        return self.following.committed.number

    def check(self) -> Checked:
        """The committed generation the hub sent, checked as every process checks a config
        (ConfigError: e.g. a tokenizer that cannot be loaded here)."""
        return self.following.committed.check()

    def poller(self, pool: Pool, clock: Callable[[], float], own: Poller, number: int) -> FollowedPoller:
        """The supervisor's probe results for generation `number`'s pool; `own` probes what the
        supervisor does not (what this worker's discovery found)."""
        return FollowedPoller(pool, self.feed, clock, own, self.following.epochs(number))

    def attach(self, parts: WorkerParts) -> Remote:
        """Answer the hub from now on; adopt the weights set at run time; the worker's coordinator."""
        self.parts = parts

        def collect(_: Any) -> list[list[Any]]:
            return dump(parts.registry)

        def stats(body: dict[str, Any]) -> dict[str, Any]:
            max_samples = body.get("max_samples") if isinstance(body, dict) else None
            return export_book(parts.book, parts.clock(), max_samples=max_samples)

        def apply_weights(body: list[Any]) -> dict[str, float]:
            model, weights = body
            return proxy_of(parts.generations.current).set_weights(str(model), {str(k): float(v)
                                                                                for k, v in weights.items()})

        def identity(_: Any) -> dict[str, Any]:
            return {"pid": os.getpid(), "requests": parts.served(),
                    "generation": parts.generations.current.number}

        handlers: dict[str, Handler] = {"collect": collect, "stats": stats, "apply_weights": apply_weights,
                                        "identity": identity}
        for name, handler in handlers.items():
            self.channel.handle(name, handler)
        self.following.attach(self.channel, parts.generations, parts.reloader, self._give_up)
        self._adopt(self.overrides)
        return Remote(self, parts.generations)

    def _adopt(self, overrides: Mapping[str, Mapping[str, float]]) -> None:
        assert self.parts is not None
        proxy = proxy_of(self.parts.generations.current)
        for model, weights in overrides.items():
            if proxy.weights(model):
                try:
                    proxy.set_weights(model, weights)
                except (KeyError, ValueError):
                    continue

    def _give_up(self) -> None:
        """Close the channel: the worker drains and exits (its supervisor starts another)."""
        self._task.cancel()

    async def resync(self) -> None:
        """Adopt the hub's state as it is now (after `attach`: no change can fall in between),
        a generation committed while this worker was starting included (ReloadRejected if it cannot
        be built here)."""
        assert self.parts is not None
        state = await self.channel.call("state")
        self.feed.publish(state.get("probes", []))
        await self.following.adopt(Received.from_wire(state["committed"]), self.parts.generations,
                                   self.parts.reloader)
        self._adopt(state.get("overrides", {}))

    async def close(self) -> None:
        await self.channel.close()
        self._task.cancel()


class Remote:
    """The coordinator of a worker: every admin action is the hub's, for all workers."""

    def __init__(self, link: WorkerLink, generations: Generations) -> None:
        self._link = link
        self._generations = generations

    def weights(self, model: str) -> dict[str, float]:
        return proxy_of(self._generations.current).weights(model)

    async def set_weights(self, model: str, weights: Mapping[str, float]) -> dict[str, float]:
        live = proxy_of(self._generations.current).set_weights(model, weights)  # validates (404, 400) here
        answer: dict[str, Any] = await self._link.channel.call("weights", [model, live], timeout_s=30.0)
        if "conflict" in answer:  # (the hub has put the winner in force on every worker, this one too)
            raise WeightsConflict(str(answer["message"]), record=answer["conflict"])
        return {str(k): float(v) for k, v in answer["weights"].items()}

    async def reload(self) -> Reloaded:
        answer = await self._link.channel.call("reload", timeout_s=120.0)
        if answer.get("errors"):
            raise ReloadRejected(list(answer["errors"]))
        return Reloaded(int(answer["generation"]), list(answer["restart_required"]))

    async def compare(self, window: int, scope: str) -> dict[str, Any]:
        doc: dict[str, Any] = await self._link.channel.call("compare", {"window": window, "scope": scope},
                                                            timeout_s=60.0)
        return doc

    async def workers(self) -> dict[str, Any]:
        doc: dict[str, Any] = await self._link.channel.call("workers", timeout_s=30.0)
        return {**doc, "answered_by": self._link.slot}

    async def metrics(self, accept: str) -> tuple[bytes, str]:
        page, content_type = await self._link.channel.call("metrics", {"accept": accept}, timeout_s=30.0)
        return str(page).encode(), str(content_type)
