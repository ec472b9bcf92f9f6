"""Per-key rate limits shared by every replica: the buckets live in Redis, replicas hold leases on them.

The same token buckets as `ratelimit.KeyLimiter` (burst = the per-minute figure, refilled
continuously; one request taken on arrival, tokens charged from usage afterwards and allowed to
overdraw), kept in one Redis hash per key and bucket. Replicas never ask Redis on a request: each
process holds a lease on each key's request bucket and charges tokens in batches
(`access.leased.LeasedLimiter`; the rules and why in `access.leases`). Redis is the authority: the
`SETTLE` script below is `leases.Authority.settle` in Lua, and Redis runs a script alone, so two
replicas settling the same key at the same instant cannot both take the last unit. The refill is
computed on Redis's own clock (`TIME`), so the replicas' clocks do not matter.

Why a token bucket and not the fixed windows of Envoy's rate-limit service (INCR + EXPIRE per
minute): a fixed window lets a client spend its budget at the end of one minute and again at the
start of the next, twice the configured rate over those seconds; a bucket grants the configured
budget over any minute (this is the generic cell rate algorithm's guarantee, in its bucket form).

Costs: one script call per key per settle, every key of a round in one pipeline on the store's
lease connection (`Store.leases`): a busy key settles a few times a second whatever its request
rate. When the store is down (`state.store`), admission and charges go to the `fallback` limiter
(the supervisor's buckets for the workers of a host, else this process's), so no request waits on,
or fails because of, Redis.
"""

from __future__ import annotations

from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from ..state.store import Store, StoreDown
from .leased import SourceDown
from .leases import HOLDER_TTL_S, Ask, Grant

# One key's buckets: KEYS = request bucket, token bucket, the key's holders (a sorted set by the
# millisecond each last settled), the holders' promises (a hash: holder -> units); ARGV =
# requests/min, tokens/min (0: no limit), units wanted, units returned, tokens charged, the holder's
# name, the holders' time to live (ms), units spent without a grant. Levels are stored with
# the millisecond they were computed at and the capacity they were computed for; a bucket that would
# be full again expires (absent = full). The same rule as `leases.Authority.settle`.
SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'at', 'cap')
  local lvl, at, c = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  if lvl == nil or at == nil or c == nil or c <= 0 then return cap end
  local f = lvl / c + math.max(now - at, 0) / 60000  -- rescaled to the same fraction, then refilled
  if f > 1 then f = 1 end
  return f * cap
end
local function store(key, cap, lvl)
  redis.call('HSET', key, 'level', string.format('%.17g', lvl), 'at', string.format('%.17g', now), 'cap', cap)
  redis.call('PEXPIRE', key, math.ceil((cap - lvl) * 60000 / cap) + 1000)
end
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local want, returned, tokens, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[7])
local spent = tonumber(ARGV[8])
redis.call('ZADD', KEYS[3], now, ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
local holders = redis.call('ZCARD', KEYS[3])
local others = 0
local promises = redis.call('HGETALL', KEYS[4])
for i = 1, #promises, 2 do
  if not redis.call('ZSCORE', KEYS[3], promises[i]) then
    redis.call('HDEL', KEYS[4], promises[i])
  elseif promises[i] ~= ARGV[6] then
    others = others + tonumber(promises[i + 1])
  end
end
local granted, req, tok, promised = 0, '', '', 0
if rpm > 0 then
  local lvl = math.min(rpm, level(KEYS[1], rpm) + returned) - spent
  local whole = math.floor(lvl - others)
  if want > 0 and whole >= 1 then
    granted = math.min(want, whole, math.max(1, math.ceil(whole / holders)))
  end
  lvl = lvl - granted
  store(KEYS[1], rpm, lvl)
  req = string.format('%.17g', lvl - others)
  promised = math.max(math.floor((lvl - others) / (holders + 1)), 0)
  redis.call('HSET', KEYS[4], ARGV[6], promised)
  redis.call('PEXPIRE', KEYS[4], ttl)
end
if tpm > 0 then
  local lvl = level(KEYS[2], tpm) - tokens
  store(KEYS[2], tpm, lvl)
  tok = string.format('%.17g', lvl)
end
return {granted, req, tok, holders, promised}
"""


async def evalsha_all(client: Redis, script: AsyncScript, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
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


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class RedisSource:
    """The fleet's buckets in Redis, as a lease source (`holder`: this process's name in the fleet)."""

    def __init__(self, store: Store, holder: str) -> None:
        self._store = store
        self.holder = holder
        self._settle = store.register_script(SETTLE)  # (its sha; loaded on first NOSCRIPT)

    def keys(self, key_id: str) -> list[str]:
        tag = "{" + key_id + "}"  # one hash slot per key, should the store be a Redis Cluster
        return [self._store.key("rl", tag, kind) for kind in ("requests", "tokens", "holders", "promises")]

    def available(self) -> bool:
        return self._store.up

    async def settle(self, asks: list[Ask]) -> list[Grant]:
        ttl_ms = int(HOLDER_TTL_S * 1000)
        calls: list[tuple[list[str], list[Any]]] = [
            (self.keys(a.key), [a.requests_per_minute, a.tokens_per_minute, a.want, a.returned, a.tokens,
                                self.holder, ttl_ms, a.spent]) for a in asks]

        async def op(_: Redis) -> list[Any]:
            return await evalsha_all(self._store.leases, self._settle, calls)

        try:
            answers = await self._store.run(op, use="limits")
        except StoreDown as exc:
            raise SourceDown(str(exc)) from exc
        grants = []
        for answer in answers:
            if isinstance(answer, Exception):
                raise SourceDown(f"{type(answer).__name__}: {answer}")
            granted, requests, tokens, holders, promised = (_text(x) for x in answer)
            grants.append(Grant(int(granted), float(requests) if requests else None,
                                float(tokens) if tokens else None, max(1, int(holders)), float(promised)))
        return grants
