"""A worker's side of the committed generation and of the two-phase reload (`commit`).

The worker builds its first generation from the committed one its hub sent at hello (`Received`),
never from the config file. Then, on the hub's word:

- `prepare` (the generation's text and secrets): `check` it as every process does and build its
  parts (`state.reload.Reloader.prepare`), changing nothing; answer the problems, if any;
- `commit`: make the prepared generation current (one that was not prepared, because this worker
  was still starting, is built now; if that fails, the worker gives up its channel, drains and
  exits, and its supervisor starts it again from the committed generation);
- `abort`: drop the prepared generation.

A worker that attaches after a commit it did not take part in adopts the committed generation from
the hub's state (`adopt`). Each generation's pool takes the supervisor's probe results of the
epochs it was committed with (`epochs`, `state.health_feed`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ..settings import ConfigError
from ..state.generations import Generation, Generations
from ..state.health_feed import ProbeFeed
from ..state.reload import Reloader, ReloadRejected
from .channel import Channel, Handler
from .committed import Received

log = logging.getLogger(__name__)


class Following:
    def __init__(self, first: Received, feed: ProbeFeed) -> None:
        self.committed = first
        self._feed = feed
        self._epochs: dict[int, dict[str, int]] = {first.number: first.epochs}
        self._pending: dict[int, Generation] = {}
        self._lock = asyncio.Lock()

    def epochs(self, number: int) -> dict[str, int]:
        """The probe epoch of each configured backend in generation `number` (being built)."""
        return self._epochs.get(number, {})

    def attach(self, channel: Channel, generations: Generations, reloader: Reloader,
               give_up: Callable[[], None]) -> None:
        """Answer the hub's prepare, commit and abort; `give_up()` closes the channel."""

        async def prepare(body: Any) -> dict[str, Any]:
            received = Received.from_wire(body)
            try:
                generation = await self._prepare(received, reloader)
            except ReloadRejected as exc:
                return {"errors": exc.errors}
            stale = self._pending.pop(received.number, None)
            if stale is not None:
                await reloader.abort(stale)
            self._pending[received.number] = generation
            return {}

        async def commit(body: Any) -> dict[str, Any]:
            received = Received.from_wire(body)
            try:
                number = await self.adopt(received, generations, reloader)
            except ReloadRejected as exc:
                log.error("cannot build the committed generation %d (%s): this worker stops, its supervisor "
                          "starts it again from that generation", received.number, "; ".join(exc.errors))
                asyncio.get_running_loop().call_soon(give_up)
                return {"errors": exc.errors}
            return {"generation": number}

        async def abort(body: Any) -> dict[str, Any]:
            generation = self._pending.pop(int(body), None)
            if generation is not None:
                await reloader.abort(generation)
            return {}

        handlers: dict[str, Handler] = {"prepare": prepare, "commit": commit, "abort": abort}
        for name, handler in handlers.items():
            channel.handle(name, handler)

    async def adopt(self, received: Received, generations: Generations, reloader: Reloader) -> int:
        """Make `received` (committed by the hub) current here, unless it already is; its number.
        ReloadRejected when it cannot be built."""
        async with self._lock:
            if generations.current.number >= received.number:
                return generations.current.number
            generation = self._pending.pop(received.number, None)
            if generation is None:
                generation = await self._prepare(received, reloader)
            for number in [n for n in self._pending if n <= received.number]:
                await reloader.abort(self._pending.pop(number))
            done = await reloader.commit(generation)
            self.committed = received
            self._epochs = {received.number: received.epochs}
            self._feed.retain(received.epochs)
            return done.generation

    async def _prepare(self, received: Received, reloader: Reloader) -> Generation:
        try:
            checked = await asyncio.to_thread(received.check)  # tokenizers load off the serving loop
        except ConfigError as exc:
            raise ReloadRejected(exc.errors) from None
        self._epochs[received.number] = received.epochs
        return reloader.prepare(checked, received.number)
