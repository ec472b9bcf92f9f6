"""Per-key rate limits shared by every replica, enforced atomically in Redis.

The same token buckets as `ratelimit.KeyLimiter` (burst = the per-minute figure, refilled
continuously; one request taken on arrival, tokens charged from usage afterwards and allowed to
overdraw), kept in one Redis hash per key and bucket and updated by a Lua script: Redis runs a script
alone, so two replicas admitting the same key at the same instant cannot both take the last unit,
and the refill is computed on Redis's own clock (`TIME`), so the replicas' clocks do not matter.

Why a token bucket and not the fixed windows of Envoy's rate-limit service (INCR + EXPIRE per
minute): a fixed window lets a client spend its budget at the end of one minute and again at the
start of the next, twice the configured rate over those seconds; a bucket grants the configured
budget over any minute (this is the generic cell rate algorithm's guarantee, in its bucket form).

Costs: one script call per request of a key that has a limit, pipelined: the admissions that arrive
while a round trip is under way go together in the next one (Envoy's rate-limit service batches its
Redis commands the same way, `REDIS_PIPELINE_WINDOW`), so a burst of concurrent requests costs a few
round trips on one connection, not one connection each; token charges are added up per key and
written every `FLUSH_S` in one pipeline, off the request path. When the store
is down (`state.store`), admission and charges go to the `fallback` limiter (the supervisor's
buckets for the workers of a host, else this process's), so no request waits on, or fails because
of, Redis.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from ..state.store import Store, StoreDown
from .ratelimit import Decision, KeyLimits, Limiter

log = logging.getLogger(__name__)

FLUSH_S = 0.02

# Both buckets of a key: KEYS = request bucket, token bucket; ARGV = requests/min, tokens/min (0: no
# limit). Levels are stored with the millisecond they were computed at; a bucket that would be full
# again expires (absent = full).
_LEVEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'at', 'cap')
  local lvl, at, c = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  if lvl == nil or c ~= cap then return cap end
  return math.min(cap, lvl + math.max(now - at, 0) * cap / 60000)
end
local function store(key, cap, lvl)
  redis.call('HSET', key, 'level', lvl, 'at', now, 'cap', cap)
  redis.call('PEXPIRE', key, math.ceil((cap - lvl) * 60000 / cap) + 1000)
end
"""
ADMIT = _LEVEL + """
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local wait, kind = 0, 'requests'
local req = nil
if rpm > 0 then
  req = level(KEYS[1], rpm)
  if req < 1 then wait = (1 - req) * 60 / rpm end
end
local tok = nil
if tpm > 0 then
  tok = level(KEYS[2], tpm)
  if tok <= 0 then
    local w = math.max(-tok * 60 / tpm, 0.001)
    if w > wait or (w == wait and 'tokens' > kind) then wait, kind = w, 'tokens' end
  end
end
local function show(x) if x == nil then return '' end return tostring(x) end
if wait > 0 then return {0, tostring(wait), kind, show(req), show(tok)} end
if req ~= nil then
  req = req - 1
  store(KEYS[1], rpm, req)
end
return {1, '0', '', show(req), show(tok)}
"""
CHARGE = _LEVEL + """
local tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2])
store(KEYS[1], tpm, level(KEYS[1], tpm) - tokens)
return 1
"""


async def evalsha_all(client: Redis, script: AsyncScript, calls: list[tuple[list[str], list[int]]]) -> list[Any]:
    """Run `script` once per (keys, args) in one round trip (a plain EVALSHA for one call, else a
    pipeline); load it first if Redis does not know it (a new or restarted Redis). redis-py's own
    pipelined scripts would ask SCRIPT EXISTS before every pipeline: a second round trip."""
    for attempt in (0, 1):
        if len(calls) == 1:
            keys, args = calls[0]
            try:
                return [await client.evalsha(script.sha, len(keys), *keys, *args)]
            except redis_errors.NoScriptError as exc:
                answers: list[Any] = [exc]
        else:
            async with client.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                answers = await pipe.execute(raise_on_error=False)
        if attempt or not any(isinstance(a, redis_errors.NoScriptError) for a in answers):
            return answers
        script.sha = await client.script_load(script.script)
    return answers


class RedisLimiter:
    """The fleet's buckets; `fallback` serves whenever the store cannot."""

    def __init__(self, store: Store, fallback: Limiter) -> None:
        self._store = store
        self.fallback = fallback
        self._admit = store.client.register_script(ADMIT)  # (its sha; loaded on first NOSCRIPT)
        self._charge = store.client.register_script(CHARGE)
        self._pending: dict[str, tuple[KeyLimits, int]] = {}
        self._flush: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._queue: list[tuple[list[str], list[int], asyncio.Future[Any]]] = []  # admissions not yet sent
        self._sending = False

    def _keys(self, key_id: str) -> list[str]:
        tag = "{" + key_id + "}"  # one hash slot per key, should the store be a Redis Cluster
        return [self._store.key("rl", tag, "requests"), self._store.key("rl", tag, "tokens")]

    async def admit(self, key: KeyLimits) -> Decision:
        rpm, tpm = key.requests_per_minute or 0, key.tokens_per_minute or 0
        if not rpm and not tpm:
            return Decision()
        if not self._store.up:
            self._store.fell_back("limits")
            return await self.fallback.admit(key)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((self._keys(key.id), [rpm, tpm], answer))
        if not self._sending:  # nothing under way: this request makes the round trip itself
            self._sending = True
            batch, self._queue = self._queue, []
            await self._round_trip(batch)
        try:
            admitted, wait, kind, req, tok = (x.decode() if isinstance(x, bytes) else x for x in await answer)
        except StoreDown:
            self._store.fell_back("limits")
            return await self.fallback.admit(key)
        levels = {k: float(v) for k, v in (("requests", req), ("tokens", tok)) if v != ""}
        if int(admitted):
            return Decision(None, levels)
        seconds = float(wait)
        return Decision((max(1, -int(-seconds // 1)), str(kind)), levels)

    def _send(self) -> None:
        batch, self._queue = self._queue, []
        if not batch:
            self._sending = False
            return
        task = asyncio.get_running_loop().create_task(self._round_trip(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _round_trip(self, batch: list[tuple[list[str], list[int], asyncio.Future[Any]]]) -> None:
        """One round trip of admissions; then the next batch, if any arrived meanwhile."""
        async def op(_: Redis) -> list[Any]:
            return await evalsha_all(self._store.admissions, self._admit, [(keys, args) for keys, args, _ in batch])

        try:
            answers = await self._store.run(op)
        except StoreDown as down:
            answers = [down] * len(batch)
        finally:
            self._send()
        for (_, _, future), answer in zip(batch, answers, strict=True):
            if future.done():
                continue
            if isinstance(answer, Exception):
                future.set_exception(answer if isinstance(answer, StoreDown) else StoreDown(str(answer)))
            else:
                future.set_result(answer)

    def charge(self, key: KeyLimits, tokens: int) -> None:
        if key.tokens_per_minute is None or tokens <= 0:
            return
        if not self._store.up:
            self._store.fell_back("limits")
            self.fallback.charge(key, tokens)
            return
        _, pending = self._pending.get(key.id, (key, 0))
        self._pending[key.id] = (key, pending + tokens)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(FLUSH_S, self._start_flush)

    def _start_flush(self) -> None:
        self._flush = None
        task = asyncio.get_running_loop().create_task(self.flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Write the charges added up since the last flush (to the fallback if the store is down)."""
        batch, self._pending = self._pending, {}
        if not batch:
            return

        async def op(client: Redis) -> Any:
            calls = [(self._keys(key.id)[1:], [key.tokens_per_minute or 0, tokens]) for key, tokens in batch.values()]
            return await evalsha_all(client, self._charge, calls)

        try:
            await self._store.run(op)
        except StoreDown:
            for key, tokens in batch.values():
                self._store.fell_back("limits")
                self.fallback.charge(key, tokens)

    async def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        await self.flush()
