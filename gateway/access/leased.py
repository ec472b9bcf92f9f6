"""A process's admissions from leases on its keys' buckets, renewed in the background (`leases` has
the rules and why).

`LeasedLimiter` is a `ratelimit.Limiter` over a `Source` (the authority, seen from this process:
Redis through `access.shared_limits.RedisSource`, the supervisor's hub through
`cluster.link.HubSource`). An admission never awaits the source while its key holds units, or while
the last answer says the bucket is empty (refused at once, with Retry-After); it waits only when
neither is known (`leases.WAIT`), at most `patience_s`. Settles go in rounds, one at a time, every
key that needs one in the same round (one pipeline to Redis, one message to the hub): renewals ahead
of need, units waited for, tokens charged (batched every `FLUSH_S`), idle units returned, stale views
refreshed.

What the source cannot decide in time is decided here, never by waiting longer:
- while a round has been under way for longer than `patience_s` (a stalled hub, a store about to
  time out), and for an admission that waited that long, the `stand_in` decides: a `ShareLimiter`
  that follows every answer, starting from what the authority promised this holder (`Grant.promised`:
  the promises of all holders add up to at most what the bucket had) and refilling at its share of
  the rate, so that N holders deciding on their own while the authority is stalled admit at most the
  budget, not N times it. A promise lapses `HOLDER_TTL_S` after the settle that brought it (the
  authority then counts it free again). What the stand-in admits is owed: reported in the next
  settle (`Ask.spent`) and taken from the bucket then, so that the budget over any minute holds;
- while the source is down (the store marked down), `fallback` decides (the host's buckets for the
  workers of a supervisor, else this process's: limits per replica for the outage, as logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

from ..tasks import cancel_all
from .leases import HOLDER_TTL_S, WAIT, Ask, Grant, Lease
from .ratelimit import Bucket, Decision, KeyLimits, Limiter

log = logging.getLogger(__name__)

FLUSH_S = 0.02  # tokens charged are reported this long after the first of them
TICK_S = 0.05  # how often leases are looked over for background settles


async def _outlived(waited: asyncio.Future[Any]) -> None:
    """Wait for `waited` to end, cancelled or not; a cancellation of the waiter itself (a timeout
    around `flush`) still propagates (suppressing every CancelledError here kept `close` waiting for
    ever on a settle that never answers)."""
    try:
        await asyncio.shield(waited)
    except asyncio.CancelledError:
        if not waited.cancelled():
            raise


class SourceDown(Exception):
    """The source cannot settle now."""


class Source(Protocol):
    def available(self) -> bool:
        """False while the source is known to be down (nothing is sent then)."""
        ...

    async def settle(self, asks: list[Ask]) -> list[Grant]:
        """One answer per ask, in order; raises SourceDown."""
        ...


class ShareLimiter:
    """A holder's own buckets at its share of each key's budget: the fallback while its source is
    stalled. `follow` sets them from each answer: the request bucket to what the authority promised
    (less what was admitted here on its own since the ask), the token bucket to the share of the
    authority's level; between answers they refill at the share of the rate, and a request bucket
    whose promise lapsed starts again from empty. A key this holder never had an answer for starts
    empty: what is left of its budget is unknown here, and another holder (a worker the key's earlier
    requests went to) may hold all of it; starting full let a stalled supervisor's second worker admit
    a whole budget more (33 of 20 in a minute)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, str], Bucket] = {}
        self._shares: dict[str, float] = {}
        self._lapses: dict[str, float] = {}  # when each key's promise lapses (after it: popped, bucket emptied)
        self.share_of_unknown = 1.0  # a key never answered: 1 / the most holders seen on any key

    def _bucket(self, key_id: str, kind: str, per_minute: int, now: float) -> Bucket:
        share = self._shares.get(key_id, self.share_of_unknown)
        capacity = max(per_minute * share, 1.0)
        bucket = self._buckets.get((key_id, kind))
        if bucket is None:  # empty until an answer says what is left (`follow`)
            bucket = self._buckets[(key_id, kind)] = Bucket(capacity, capacity / 60.0, 0.0, now)
        bucket.refill(now)
        if bucket.capacity != capacity:
            bucket.rescaled(capacity)
        if kind == "requests" and now >= self._lapses.get(key_id, math.inf):
            del self._lapses[key_id]  # the authority may have granted the promised units to others by now
            bucket.level = min(bucket.level, 0.0)
        return bucket

    def follow(self, key: KeyLimits, grant: Grant, *, asked_at: float, spent_since: int) -> None:
        """An answer to an ask sent at `asked_at`; `spent_since`: what this stand-in admitted after."""
        now = self._clock()
        share = 1.0 / max(grant.holders, 1)
        self._shares[key.id] = share
        self.share_of_unknown = min(self.share_of_unknown, share)
        if key.requests_per_minute and grant.requests is not None:
            bucket = self._bucket(key.id, "requests", key.requests_per_minute, now)
            bucket.level = min(bucket.capacity, grant.promised - spent_since)  # (a lapse there is replaced)
            self._lapses[key.id] = asked_at + HOLDER_TTL_S  # before the authority's own clock lets it go
        if key.tokens_per_minute and grant.tokens is not None:
            bucket = self._bucket(key.id, "tokens", key.tokens_per_minute, now)
            bucket.level = min(bucket.capacity, grant.tokens * share)

    async def admit(self, key: KeyLimits) -> Decision:
        now = self._clock()
        waits = [(0.0, "requests")]
        levels: dict[str, float] = {}
        requests = None
        if key.requests_per_minute:
            requests = self._bucket(key.id, "requests", key.requests_per_minute, now)
            waits.append((requests.wait_s(1.0), "requests"))
        if key.tokens_per_minute:
            tokens = self._bucket(key.id, "tokens", key.tokens_per_minute, now)
            levels["tokens"] = tokens.level
            waits.append((0.0 if tokens.level > 0 else max(-tokens.level / tokens.per_s, 1e-3), "tokens"))
        wait, kind = max(waits)
        if wait <= 0 and requests is not None:
            requests.level -= 1.0
        if requests is not None:
            levels["requests"] = requests.level
        return Decision(None if wait <= 0 else (max(1, math.ceil(wait)), kind), levels)

    def charge(self, key: KeyLimits, tokens: int) -> None:
        if key.tokens_per_minute and tokens > 0:
            self._bucket(key.id, "tokens", key.tokens_per_minute, self._clock()).level -= tokens


class LeasedLimiter:
    """Admissions from leases held here; `fallback` whenever the source cannot answer in time."""

    def __init__(
        self, source: Source, fallback: Limiter | None = None, *, clock: Callable[[], float], patience_s: float,
        fell_back: Callable[[], None] | None = None,
    ) -> None:
        """`fallback`: while the source is down (default: the stand-in); `fell_back()` is called for
        every decision it makes (the stand-in's are this holder's own, from its lease: not counted)."""
        self._source = source
        self.stand_in = ShareLimiter(clock)
        self.fallback: Limiter = fallback if fallback is not None else self.stand_in
        self._clock = clock
        self._patience_s = patience_s
        self._fell_back = fell_back
        self._leases: dict[str, tuple[KeyLimits, Lease]] = {}
        self._urgent: set[str] = set()
        self._next: asyncio.Future[bool] | None = None  # completes with the next round (True: answered)
        self._round: asyncio.Task[None] | None = None
        self._round_started: float | None = None
        self._round_trip_s = 0.0
        self._ticker: asyncio.Task[None] | None = None
        self._closed = False

    # -- the request path -----------------------------------------------------------------------------

    def _lease(self, key: KeyLimits) -> Lease:
        entry = self._leases.get(key.id)
        if entry is None:
            entry = self._leases[key.id] = (key, Lease())
            if self._ticker is None and not self._closed:
                self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="lease-ticker")
        elif entry[0] is not key:
            self._leases[key.id] = (key, entry[1])  # the key's latest limits (a reload may change them)
        return entry[1]

    def _late(self, now: float) -> bool:
        return self._round_started is not None and now - self._round_started > self._patience_s

    async def admit(self, key: KeyLimits) -> Decision:
        rpm, tpm = key.requests_per_minute or 0, key.tokens_per_minute or 0
        if not rpm and not tpm:
            return Decision()
        if not self._source.available():
            return await self._fall_back(key, self.fallback)
        lease = self._lease(key)
        lease.arrived(self._clock())
        deadline: float | None = None
        while True:
            now = self._clock()
            verdict = lease.decide(rpm, tpm, now)
            if verdict != WAIT:
                if verdict is None and lease.low(rpm, now, self._round_trip_s):
                    self._kick(key.id)
                refused = verdict if isinstance(verdict, tuple) else None
                return Decision(refused, lease.levels(rpm, tpm, now))
            if self._late(now):
                return await self._fall_back(key, self.stand_in)
            deadline = now + self._patience_s if deadline is None else deadline
            lease.waiting += 1
            answered = self._kick(key.id)
            try:
                async with asyncio.timeout(max(deadline - now, 0.0)):
                    ok = await asyncio.shield(answered)
            except TimeoutError:
                ok = False
            finally:
                lease.waiting -= 1
            if not ok:
                return await self._fall_back(key, self.stand_in if self._source.available() else self.fallback)

    async def _fall_back(self, key: KeyLimits, limiter: Limiter) -> Decision:
        if limiter is not self.stand_in:
            if self._fell_back is not None:
                self._fell_back()
            return await limiter.admit(key)
        decision = await limiter.admit(key)
        if decision.refused is None and key.requests_per_minute:
            self._lease(key).borrowed(self._clock())
        return decision

    def charge(self, key: KeyLimits, tokens: int) -> None:
        if key.tokens_per_minute is None or tokens <= 0:
            return
        now = self._clock()
        if not self._source.available():
            if self._fell_back is not None:
                self._fell_back()
            self.fallback.charge(key, tokens)
            return
        if self._late(now):  # the stand-in is deciding: it must see the charge too
            self.stand_in.charge(key, tokens)
        self._lease(key).charge(tokens, now)

    # -- rounds ----------------------------------------------------------------------------------------

    def _kick(self, key_id: str | None = None) -> asyncio.Future[bool]:
        """Have `key_id` settled in the next round (now, unless one is under way); that round's future."""
        loop = asyncio.get_running_loop()
        if key_id is not None:
            self._urgent.add(key_id)
        if self._next is None:
            self._next = loop.create_future()
        answered = self._next
        if self._round is None:
            self._round = loop.create_task(self._rounds(), name="lease-settle")
        return answered

    async def _rounds(self) -> None:
        try:
            while self._urgent:
                await self._one_round()
        finally:
            self._round = None
            self._round_started = None
            if self._urgent and not self._closed:
                self._kick()

    async def _one_round(self) -> None:
        now = self._clock()
        keys, self._urgent = self._urgent, set()
        answered, self._next = self._next, None
        batch: list[tuple[KeyLimits, Lease, Ask]] = []
        for key_id in keys:
            entry = self._leases.get(key_id)
            if entry is not None:
                key, lease = entry
                ask = lease.ask(key.id, key.requests_per_minute or 0, key.tokens_per_minute or 0, now,
                                self._round_trip_s)
                batch.append((key, lease, ask))
        ok = False
        try:
            if batch:
                self._round_started = now
                try:
                    grants = await self._source.settle([ask for _, _, ask in batch])
                except SourceDown:
                    for _, lease, ask in batch:
                        lease.unanswered(ask)
                else:
                    ok = True
                    done = self._clock()
                    took = done - now
                    self._round_trip_s = took if not self._round_trip_s else 0.8 * self._round_trip_s + 0.2 * took
                    for (key, lease, _), grant in zip(batch, grants, strict=True):
                        lease.answered(grant, done)
                        self.stand_in.follow(key, grant, asked_at=now, spent_since=lease.spent)
        finally:
            self._round_started = None
            if answered is not None and not answered.done():
                answered.set_result(ok)

    async def _tick(self) -> None:
        """Look the leases over for background settles; forget the ones long unused."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self._look_over()
            except Exception:  # a bug here must not stop the renewals
                log.exception("rate-limit leases: looking over the leases failed")

    def _look_over(self) -> None:
        now = self._clock()
        if not self._source.available():
            return
        due = False
        for key_id, (key, lease) in list(self._leases.items()):
            if lease.forgettable(now):
                del self._leases[key_id]
            elif lease.due(key.requests_per_minute or 0, key.tokens_per_minute or 0, now, flush_s=FLUSH_S):
                self._urgent.add(key_id)
                due = True
        if due:
            self._kick()

    async def flush(self) -> None:
        """Settle every lease now: report what is owed (tests, and before closing)."""
        self._urgent.update(self._leases)
        while self._round is not None:
            await _outlived(self._round)
        if self._urgent and self._source.available():
            await _outlived(self._kick())

    async def close(self) -> None:
        """Give back what is held and report what is owed (bounded by the patience), then stop."""
        self._closed = True
        if self._ticker is not None:
            await cancel_all([self._ticker])
        for _, lease in self._leases.values():
            lease.used_at = -math.inf  # everything held is idle now: returned by the last round
        if self._source.available():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._patience_s * 2):
                    await self.flush()
        if self._round is not None:
            await cancel_all([self._round])
