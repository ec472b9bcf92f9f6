"""Live A/B weights shared by every replica through the store, and kept across restarts.

A weight change (`PUT /admin/routes/{model}/weights`) is written to one Redis hash,
`<prefix>:weights`, field = the route's model, value = the record: the weights, the fingerprint of
the split they were set for, the version Redis gave it, and (for people) by which replica and when.
Every replica reads the hash every `state.sync_interval_s` (0.2 s by default) and applies each
record whose version is newer than the one it has, so a change is in force on all of them within
that interval plus one round trip, and a replica that starts (or restarts) reads the hash before it
serves. Polling one small hash is what Kong's cluster events do with their database: unlike pub/sub
it needs no resubscribe-and-resync protocol after a disconnect, and it costs a few reads per second
per replica.

Writes are ordered by the store, never by the replicas' clocks (which disagree: a replica whose
clock is ahead would win every race, and a change made on the others would be answered 200 and
reverted at their next read). A write names the version it was made on (the newest this replica had
read for the route); the `PUT_VERSIONED` script writes it only if that is still the stored version,
with a new version that Redis issues: its own clock in microseconds, moved past the stored version
(a hybrid logical clock: increasing per route even if Redis's clock steps back, and past everything
written before a restart that lost the hash). A write made on an older version loses: the caller
gets `WeightsConflict` with the winning record (409 at the admin API), this replica adopts the
winner, and nothing that was answered 200 is ever undone by another replica's write.

An override applies only where the route's split is configured as it was when the weights were set
(the same fingerprint): a replica whose config differs, or that reloaded a changed split, keeps the
file's weights (the same rule as `state.splits` for a reload). A change made while the store is
down is applied locally at once and written when the store is back, on the version it was made on:
if another replica wrote the route meanwhile, that write wins, and this replica logs that its change
was superseded and adopts the winner.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from ..errors import WeightsConflict
from ..settings import Settings
from ..state.store import Store, StoreDown

log = logging.getLogger(__name__)

Apply = Callable[[str, dict[str, float]], Awaitable[None]]

# KEYS[1] = the hash; ARGV = field, the version the write was made on, the record as JSON without its
# version. Written when that is the stored version (or nothing is stored); answers {1, the stored
# record} or {0, the record that won}.
PUT_VERSIONED = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
local base = tonumber(ARGV[2])
local current = 0
if old then
  local ok, decoded = pcall(cjson.decode, old)
  if ok and type(decoded) == 'table' then current = tonumber(decoded['version']) or 0 end
  if current ~= base then return {0, old} end
end
local t = redis.call('TIME')
local version = math.max(current + 1, base + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
local record = '{"version":' .. string.format('%d', version) .. ',' .. string.sub(ARGV[3], 2)
redis.call('HSET', KEYS[1], ARGV[1], record)
return {1, record}
"""


def fingerprints(settings: Settings) -> dict[str, str]:
    """route model -> a digest of its configured split (the arms, weights, backends and stickiness)."""
    return {
        r.model: hashlib.sha256(r.split.model_dump_json().encode()).hexdigest()[:16]
        for r in settings.routes if r.split is not None
    }


@dataclass(frozen=True, slots=True)
class Override:
    weights: dict[str, float]
    split: str
    version: int  # issued by the store (0: not written yet)
    by: str
    at: float  # Unix ms by the writer's clock: for people reading the record, never for ordering

    def encode(self) -> bytes:
        """The record as the script takes it: without its version (the store issues that)."""
        return orjson.dumps({"weights": self.weights, "split": self.split, "by": self.by, "at": self.at})

    def public(self) -> dict[str, Any]:
        return {"weights": self.weights, "version": self.version, "by": self.by, "at_ms": self.at}

    @staticmethod
    def decode(raw: bytes | str) -> Override | None:
        try:
            d = orjson.loads(raw)
            return Override({str(k): float(v) for k, v in d["weights"].items()}, str(d["split"]),
                            int(d.get("version", 0)), str(d.get("by", "")), float(d.get("at", 0.0)))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            return None


def conflict(model: str, winner: Override | None) -> WeightsConflict:
    record = winner.public() if winner is not None else {}
    by = f" by {winner.by}" if winner is not None and winner.by else ""
    return WeightsConflict(
        f"The weights of `{model}` were changed{by} (version {record.get('version', '?')}) after the version "
        "this change was made on; it was not applied. The winning record is in `record`: read the weights "
        "again and repeat the change if it still stands.", record=record)


class _Lost(Exception):
    """A write made on an older version than the stored one."""

    def __init__(self, winner: Override | None) -> None:
        super().__init__()
        self.winner = winner


def configured_weights(settings: Settings, model: str) -> dict[str, float]:
    """The weights the config file gives a split route (empty for other routes)."""
    for route in settings.routes:
        if route.model == model and route.split is not None:
            return {arm.name: float(arm.weight) for arm in route.split.arms}
    return {}


class SharedWeights:
    """Writes this replica's weight changes to the store and applies everyone's (`apply`)."""

    def __init__(
        self, store: Store, *, replica: str, apply: Apply, fingerprints: Callable[[], Mapping[str, str]],
        interval_s: float, wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._replica = replica
        self._apply = apply
        self._fingerprints = fingerprints
        self._interval_s = interval_s
        self._wall = wall_clock  # only for the record's `at` (read by people), never for ordering
        self._put = store.register_script(PUT_VERSIONED)
        self._versions: dict[str, int] = {}  # the newest version read or written per model (any split)
        self._known: dict[str, Override] = {}  # the override in force here per model (this split)
        self._pending: dict[str, Override] = {}  # made while the store was down (on `version`)
        self._task: asyncio.Task[None] | None = None
        store.on_up.append(self.flush_pending)

    @property
    def key(self) -> str:
        return self._store.key("weights")

    async def put(self, model: str, weights: Mapping[str, float], *, previous: Mapping[str, float]) -> bool:
        """Share a change already applied here, made on the newest version this replica has read.
        True once stored; False when the store is down (written when it is back). Raises
        WeightsConflict when another replica's write came first: then the winner is applied here
        (`previous` if the winner is for another split), and nothing was stored."""
        split = self._fingerprints().get(model)
        if split is None:
            return False
        override = Override(dict(weights), split, self._versions.get(model, 0), self._replica, self._wall() * 1000)
        try:
            await self._write(model, override)
        except StoreDown:
            self._store.fell_back("weights")
            self._pending[model] = self._known[model] = override
            return False
        except _Lost as lost:
            winner = lost.winner
            if winner is not None and winner.split == split:
                self._known[model] = winner
                await self._apply(model, winner.weights)
            else:
                await self._apply(model, dict(previous))
            raise conflict(model, winner) from None
        return True

    async def _write(self, model: str, override: Override) -> Override:
        """Store `override` if its version is still the stored one: the stored record (`_Lost`, with
        the winning one, otherwise)."""
        async def op(client: Redis) -> Any:
            return await self._put(keys=[self.key], args=[model, override.version, override.encode()], client=client)

        won, raw = await self._store.run(op, use="weights")
        record = Override.decode(raw) if raw else None
        if record is not None:
            self._versions[model] = max(self._versions.get(model, 0), record.version)
        if not int(won):
            raise _Lost(record)
        assert record is not None
        self._known[model] = record
        return record

    async def flush_pending(self) -> None:
        """Write the changes made during an outage, each on the version it was made on: one that
        another replica superseded meanwhile is dropped (and the winner adopted at the next read)."""
        while self._pending:
            model, override = next(iter(self._pending.items()))
            try:
                await self._write(model, override)
            except _Lost as lost:
                log.warning("the weights of %s set on this replica while the store was down were superseded by a "
                            "change written meanwhile (%s): adopting that one", model,
                            lost.winner.public() if lost.winner is not None else "?")
            if self._pending.get(model) is override:
                del self._pending[model]

    async def sync_once(self) -> int:
        """Read the shared weights and apply every override that is newer than the one in force here
        and fits this config; how many were applied (StoreDown when the store is down)."""
        async def op(client: Redis) -> dict[Any, Any]:
            found: dict[Any, Any] = await client.hgetall(self.key)
            return found

        stored = await self._store.run(op, use="weights")
        mine = self._fingerprints()
        applied = 0
        for raw_model, raw in stored.items():
            model = raw_model.decode() if isinstance(raw_model, bytes) else str(raw_model)
            override = Override.decode(raw)
            if override is None:
                continue
            self._versions[model] = max(self._versions.get(model, 0), override.version)
            if mine.get(model) != override.split or model in self._pending:
                continue
            known = self._known.get(model)
            if known is not None and known.version >= override.version:
                continue
            self._known[model] = override
            try:
                await self._apply(model, override.weights)
                applied += 1
            except (KeyError, ValueError) as exc:
                log.warning("shared weights for %s not applied: %s", model, exc)
        return applied

    def forget(self, models: set[str]) -> None:
        """Routes whose split changed (a reload): what was known of them no longer applies."""
        for model in models:
            self._known.pop(model, None)
            self._pending.pop(model, None)

    async def start(self) -> None:
        """Apply what the store holds now (before serving), then keep polling."""
        with contextlib.suppress(StoreDown):
            await self.sync_once()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="shared-weights")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            with contextlib.suppress(StoreDown):
                await self.sync_once()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
