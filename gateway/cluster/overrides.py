"""Live A/B weights shared by every replica through the store, and kept across restarts.

A weight change (`PUT /admin/routes/{model}/weights`) is written to one Redis hash,
`<prefix>:weights`, field = the route's model, value = the weights, the fingerprint of the split
they were set for, when (Unix ms) and by which replica. Every replica reads the hash every
`state.sync_interval_s` (0.2 s by default) and applies what changed, so a change is in force on all
of them within that interval plus one round trip, and a replica that starts (or restarts) reads the
hash before it serves. Polling one small hash is what Kong's cluster events do with their database:
unlike pub/sub it needs no resubscribe-and-resync protocol after a disconnect, and it costs a few
reads per second per replica.

An override applies only where the route's split is configured as it was when the weights were set
(the same fingerprint): a replica whose config differs, or that reloaded a changed split, keeps the
file's weights (the same rule as `state.splits` for a reload). Concurrent writes: the newer
timestamp wins, atomically (a Lua compare-and-set). A change made while the store is down is applied
locally at once and written when the store is back, unless a newer one was written meanwhile.
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

from ..settings import Settings
from ..state.store import Store, StoreDown

log = logging.getLogger(__name__)

Apply = Callable[[str, dict[str, float]], Awaitable[None]]

# KEYS[1] = the hash; ARGV = field, value, its timestamp. Written only when newer than what is there.
PUT_IF_NEWER = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  local ok, decoded = pcall(cjson.decode, old)
  if ok and decoded['at'] and tonumber(decoded['at']) > tonumber(ARGV[3]) then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
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
    at: float  # Unix ms
    by: str

    def encode(self) -> bytes:
        return orjson.dumps({"weights": self.weights, "split": self.split, "at": self.at, "by": self.by})

    @staticmethod
    def decode(raw: bytes | str) -> Override | None:
        try:
            d = orjson.loads(raw)
            return Override({str(k): float(v) for k, v in d["weights"].items()}, str(d["split"]), float(d["at"]),
                            str(d.get("by", "")))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            return None


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
        self._wall = wall_clock
        self._put = store.client.register_script(PUT_IF_NEWER)
        self._known: dict[str, Override] = {}  # the newest override seen (or made) per model
        self._pending: dict[str, Override] = {}  # made while the store was down
        self._task: asyncio.Task[None] | None = None
        store.on_up.append(self.flush_pending)

    @property
    def key(self) -> str:
        return self._store.key("weights")

    async def put(self, model: str, weights: Mapping[str, float]) -> bool:
        """Share a change already applied here; False when the store is down (it is written later)."""
        split = self._fingerprints().get(model)
        if split is None:
            return False
        override = Override(dict(weights), split, self._wall() * 1000, self._replica)
        self._known[model] = override
        try:
            await self._write(model, override)
        except StoreDown:
            self._store.fell_back("weights")
            self._pending[model] = override
            return False
        return True

    async def _write(self, model: str, override: Override) -> None:
        async def op(client: Redis) -> Any:
            return await self._put(keys=[self.key], args=[model, override.encode(), override.at], client=client)

        await self._store.run(op)

    async def flush_pending(self) -> None:
        """Write the changes made during an outage (each only if nobody wrote a newer one since)."""
        while self._pending:
            model, override = next(iter(self._pending.items()))
            await self._write(model, override)
            if self._pending.get(model) is override:
                del self._pending[model]

    async def sync_once(self) -> int:
        """Read the shared weights and apply every override that is new and fits this config; how
        many were applied (StoreDown when the store is down)."""
        async def op(client: Redis) -> dict[Any, Any]:
            found: dict[Any, Any] = await client.hgetall(self.key)
            return found

        stored = await self._store.run(op)
        mine = self._fingerprints()
        applied = 0
        for raw_model, raw in stored.items():
            model = raw_model.decode() if isinstance(raw_model, bytes) else str(raw_model)
            override = Override.decode(raw)
            if override is None or mine.get(model) != override.split or model in self._pending:
                continue
            known = self._known.get(model)
            if known is not None and (known.at, known.weights) == (override.at, override.weights):
                continue
            if known is not None and known.at > override.at:
                continue  # ours is newer and on its way
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
