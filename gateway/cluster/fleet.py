"""Every replica's windows in the store, for `GET /admin/compare?scope=fleet`.

Each replica (its supervisor, or the process itself with one worker) publishes its whole-gateway
window data (`stats.export`, reservoirs thinned to `MAX_SAMPLES` each) every
`state.publish_interval_s` under `<prefix>:fleet:<replica>`, zlib-compressed, with a time to live of
three intervals, and lists itself in the sorted set `<prefix>:fleet` scored by the time it did. The
fleet view merges its own fresh data with every other replica's that is still alive (a replica that
stopped publishing drops out when its key expires; the set is pruned as it is read). Each replica's
own view (`scope=replica`) stays the default: the fleet view is at most one interval old for the
other replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from redis.asyncio import Redis

from ..state.store import Store, StoreDown
from ..stats.export import Export

log = logging.getLogger(__name__)

MAX_SAMPLES = 16
ExportFn = Callable[[int | None], Awaitable[Export]]  # (max samples per reservoir) -> this replica's export


class FleetStats:
    def __init__(
        self, store: Store, *, replica: str, export: ExportFn, interval_s: float, workers: Callable[[], int],
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self.replica = replica
        self._export = export
        self._interval_s = interval_s
        self._workers = workers
        self._wall = wall_clock
        self.ttl_s = max(3 * interval_s, 5.0)
        self._task: asyncio.Task[None] | None = None

    def _key(self, replica: str) -> str:
        return self._store.key("fleet", replica)

    async def publish_once(self) -> None:
        doc = await self._export(MAX_SAMPLES)
        doc = {**doc, "replica": self.replica, "workers": self._workers(), "published_at": self._wall()}
        blob = zlib.compress(orjson.dumps(doc), 1)
        index, key, ttl_ms, now_ms = self._store.key("fleet"), self._key(self.replica), int(self.ttl_s * 1000), \
            self._wall() * 1000

        async def op(client: Redis) -> Any:
            async with client.pipeline(transaction=False) as pipe:
                pipe.set(key, blob, px=ttl_ms)
                pipe.zadd(index, {self.replica: now_ms})
                pipe.zremrangebyscore(index, "-inf", now_ms - ttl_ms)
                return await pipe.execute()

        await self._store.run(op, use="fleet")

    async def others(self) -> list[Export]:
        """The live exports of every other replica (StoreDown when the store is down)."""
        index = self._store.key("fleet")
        since = self._wall() * 1000 - self.ttl_s * 1000

        async def op(client: Redis) -> list[Any]:
            members: list[Any] = await client.zrangebyscore(index, since, "+inf")
            names = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
            names = [n for n in names if n != self.replica]
            if not names:
                return []
            found: list[Any] = await client.mget([self._key(n) for n in names])
            return found

        out: list[Export] = []
        for blob in await self._store.run(op, use="fleet"):
            if blob is None:
                continue  # expired between the two reads
            with contextlib.suppress(zlib.error, orjson.JSONDecodeError):
                out.append(orjson.loads(zlib.decompress(blob)))
        return out

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fleet-stats")

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(StoreDown):
                try:
                    await self.publish_once()
                except StoreDown:
                    raise
                except Exception:
                    log.exception("fleet: publishing this replica's windows failed")
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def replica_row(doc: Export, now_wall: float) -> dict[str, Any]:
    return {"replica": doc.get("replica"), "workers": doc.get("workers"),
            "age_s": max(now_wall - float(doc.get("published_at", now_wall)), 0.0)}
