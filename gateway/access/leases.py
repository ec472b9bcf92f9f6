"""Leased rate limits, the pure part: how an authority settles a holder's ask, and what a holder
decides from its lease alone. No I/O, no clock reads (time comes in as arguments).

Why leases. A key's buckets must be one budget for every process that admits its requests (the
workers of a host, the replicas of a fleet), but asking the process that owns them (the supervisor's
hub, Redis) on every request puts that process's latency and stalls on the request path. So the
owner (the *authority*) hands each admitting process (a *holder*) a lease: a few request units taken
from the bucket at once, spent locally, renewed in the background before they run out, and given
back when unused. Tokens cannot be leased (a request's tokens are known only after it), so holders
charge them in batches and decide on the authority's last answer about the token bucket.

The authority's rule (`settle`, and the same in Lua for Redis, `access.shared_limits`):
- a bucket stored at another capacity (replicas or workers disagreeing on a key's limit during a
  rolling deploy, an `api_keys_file` re-read on some only) is rescaled to the same fraction full,
  never refilled (`ratelimit.Bucket.rescaled` has the rule and why);
- returned units go back (up to the capacity); charged tokens, and request units a holder admitted
  on its own while it could not wait for an answer (`Ask.spent`), come off: the bucket may go below
  zero, and the next requests wait until it refills;
- the grant is at most what was wanted, the whole units there are, and a fair share of them:
  `ceil(units / holders)`, where holders are the processes that settled this key in the last
  `HOLDER_TTL_S` seconds, so that one holder cannot take the bucket from the others;
- every answer also *promises* the holder a part of what is left (`Grant.promised`): what it may
  admit on its own should the authority stop answering (its stand-in, `leased.ShareLimiter`). The
  units other holders were promised are not granted (`Grant.requests` is the level less them), so
  that all the holders' stand-ins together admit at most what the bucket had, however old each one's
  answer is. A promise holds while its holder is a holder (`HOLDER_TTL_S` after its last settle); it
  is the whole units in `1 / (holders + 1)` of what the others' promises leave, one share kept for a
  holder not yet seen (whole units: a fraction of one would keep a small budget's last unit from
  everyone).
  (Shares of the level as each holder last saw it did not hold: a worker that answered one request,
  and then saw none while its peer took seven of the units, admitted 19 of 20 more on its own.)

Units are deducted when granted, so whatever the holders do the fleet admits at most what the
authority granted: the configured budget. What a lease costs is the other way: units held by a
process whose clients stopped asking are unavailable to the others until it returns them
(`IDLE_RETURN_S`). Lease sizes follow each holder's demand (`Lease.target`: its request rate over the
horizon a renewal takes), so a holder never holds more than what it spends in a few round trips.

The holder's rule (`Lease.decide`): admit from held units; with none, refuse at once when the
authority's last answer (plus its refill since) shows less than one unit left; otherwise wait for a
renewal (`WAIT`: a key's first request in this process, or one that arrives after its lease ran dry
while the bucket may still have units). A sparse key (too few requests a second to keep a lease)
waits one round trip per request; a busy key decides locally.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .ratelimit import fraction_now

HOLDER_TTL_S = 5.0  # a holder that has not settled a key for this long is no longer counted for it
TAU_S = 0.5  # the demand estimate's time constant
MIN_HORIZON_S = 0.1  # a lease covers at least this much of its holder's demand ...
HORIZON_ROUND_TRIPS = 3.0  # ... and at least this many renewal round trips
IDLE_RETURN_S = 1.0  # held units unused for this long go back to the authority
REFRESH_S = 0.5  # a key in use settles at least this often (the token level, others' spending)
FORGET_S = 60.0  # a lease with nothing held or owed, unused for this long, is forgotten
WAIT = "wait"


@dataclass(frozen=True, slots=True)
class Ask:
    """What a holder asks of one key's buckets (0: the key has no such limit)."""

    key: str
    requests_per_minute: int
    tokens_per_minute: int
    want: int = 0  # request units it would like (more) of
    returned: int = 0  # request units it gives back
    tokens: int = 0  # tokens its requests used since it last settled
    spent: int = 0  # request units it admitted without a grant (its stand-in decided), to be taken now

    def encode(self) -> list[object]:
        return [self.key, self.requests_per_minute, self.tokens_per_minute, self.want, self.returned, self.tokens,
                self.spent]

    @staticmethod
    def decode(raw: list[object]) -> Ask:
        key, rpm, tpm, want, returned, tokens, spent = raw
        return Ask(str(key), int(str(rpm)), int(str(tpm)), int(str(want)), int(str(returned)), int(str(tokens)),
                   int(str(spent)))


@dataclass(frozen=True, slots=True)
class Grant:
    """The authority's answer: units granted, the buckets' levels after (None: no such limit), and
    how many holders share the key."""

    granted: int
    requests: float | None  # what is left for this holder: the level less the others' promises
    tokens: float | None
    holders: int
    promised: float = 0.0  # request units this holder may admit on its own, should the authority stall

    def encode(self) -> list[object]:
        return [self.granted, self.requests, self.tokens, self.holders, self.promised]

    @staticmethod
    def decode(raw: list[object]) -> Grant:
        granted, requests, tokens, holders, promised = raw
        return Grant(int(str(granted)), None if requests is None else float(str(requests)),
                     None if tokens is None else float(str(tokens)), max(1, int(str(holders))), float(str(promised)))


def grant_size(level: float, want: int, holders: int) -> int:
    """At most what is wanted, the whole units there are, and a fair share of them."""
    whole = math.floor(level)
    if want <= 0 or whole < 1:
        return 0
    return min(want, whole, max(1, math.ceil(whole / max(holders, 1))))


@dataclass(slots=True)
class Stored:
    """One bucket as an authority keeps it: its level at `at` (seconds), at `capacity`."""

    level: float
    at: float
    capacity: float

    def now(self, capacity: float, now: float) -> float:
        """The level at `now` and `capacity` (rescaled to the same fraction, then refilled)."""
        return capacity * fraction_now(self.level, self.capacity, now - self.at)


class Authority:
    """The buckets of one authority (the hub's; Redis runs the same rule in Lua)."""

    def __init__(self) -> None:
        self._requests: dict[str, Stored] = {}
        self._tokens: dict[str, Stored] = {}
        self._holders: dict[str, dict[str, float]] = {}
        self._promises: dict[str, dict[str, float]] = {}

    def settle(self, holder: str, ask: Ask, now: float) -> Grant:
        seen = self._holders.setdefault(ask.key, {})
        promises = self._promises.setdefault(ask.key, {})
        seen[holder] = now
        for name in [h for h, at in seen.items() if now - at > HOLDER_TTL_S]:
            del seen[name]
            promises.pop(name, None)
        holders = len(seen)
        granted, requests, tokens, promised = 0, None, None, 0.0
        if ask.requests_per_minute > 0:
            cap = float(ask.requests_per_minute)
            old = self._requests.get(ask.key)
            level = min(cap, (cap if old is None else old.now(cap, now)) + ask.returned) - ask.spent
            others = sum(v for h, v in promises.items() if h != holder)
            granted = grant_size(level - others, ask.want, holders)
            level -= granted
            self._requests[ask.key] = Stored(level, now, cap)
            requests = level - others
            promised = promises[holder] = float(max(math.floor(requests / (holders + 1)), 0))
        if ask.tokens_per_minute > 0:
            cap = float(ask.tokens_per_minute)
            old = self._tokens.get(ask.key)
            tokens = (cap if old is None else old.now(cap, now)) - ask.tokens
            self._tokens[ask.key] = Stored(tokens, now, cap)
        return Grant(granted, requests, tokens, holders, promised)

    def forget(self, holder: str) -> None:
        """A holder is gone (a worker exited): it no longer counts for the fair share, and what it
        was promised is free again."""
        for seen in self._holders.values():
            seen.pop(holder, None)
        for promises in self._promises.values():
            promises.pop(holder, None)


Verdict = tuple[int, str] | str | None  # None: admitted; (Retry-After s, kind): refused; WAIT


@dataclass(slots=True)
class Lease:
    """One key at one holder: the units it holds, what it owes, and the authority's last answer."""

    held: int = 0
    spent: int = 0  # request units admitted here without a grant (by the stand-in), not yet reported
    tokens_owed: int = 0
    owed_since: float = 0.0
    waiting: int = 0  # admissions waiting for the next settle
    requests: float | None = None  # the request bucket's level at the authority's last answer
    tokens: float | None = None
    seen_at: float = 0.0
    holders: int = 1
    demand: float = 0.0  # requests a second arriving here (admitted or not), decayed (`TAU_S`)
    demand_at: float = 0.0
    used_at: float = field(default=-math.inf)
    settled_at: float = field(default=-math.inf)

    # -- what the authority has, as far as this holder knows ------------------------------------------

    def requests_now(self, rpm: int, now: float) -> float | None:
        if self.requests is None:
            return None
        return rpm * fraction_now(self.requests, rpm, now - self.seen_at)

    def tokens_now(self, tpm: int, now: float) -> float | None:
        if self.tokens is None:
            return None
        return tpm * fraction_now(self.tokens, tpm, now - self.seen_at) - self.tokens_owed

    def levels(self, rpm: int, tpm: int, now: float) -> dict[str, float]:
        """For the rate-limit headers: what is left, as this holder sees it (what the authority has,
        plus what this holder holds)."""
        out: dict[str, float] = {}
        if rpm:
            shared = self.requests_now(rpm, now)
            out["requests"] = min(float(rpm), (rpm if shared is None else shared) + self.held)
        if tpm:
            tokens = self.tokens_now(tpm, now)
            out["tokens"] = float(tpm) if tokens is None else tokens
        return out

    # -- admission -------------------------------------------------------------------------------------

    def decide(self, rpm: int, tpm: int, now: float) -> Verdict:
        """Admit (taking a held unit), refuse (with the whole seconds to wait and which budget), or
        WAIT for the authority's answer."""
        waits = [(0.0, "requests")]
        unknown = False
        if tpm:
            tokens = self.tokens_now(tpm, now)
            if tokens is None:
                unknown = True
            elif tokens <= 0:
                waits.append((max(-tokens / (tpm / 60.0), 1e-3), "tokens"))
        if rpm and self.held < 1:
            shared = self.requests_now(rpm, now)
            if shared is None or shared >= 1.0:
                unknown = True
            else:
                waits.append(((1.0 - shared) / (rpm / 60.0), "requests"))
        wait, kind = max(waits)
        if wait > 0:
            return max(1, math.ceil(wait)), kind
        if unknown:
            return WAIT
        if rpm:
            self.held -= 1
        return None

    def arrived(self, now: float) -> None:
        """A request for this key arrived (once per request, before `decide`): the demand a lease is
        sized to counts requests, not admissions, so that a lease run dry grows at once."""
        self.demand = self.demand_now(now) + 1.0 / TAU_S
        self.demand_at = self.used_at = now

    def demand_now(self, now: float) -> float:
        return self.demand * math.exp(-max(now - self.demand_at, 0.0) / TAU_S)

    def charge(self, tokens: int, now: float) -> None:
        if not self.tokens_owed:
            self.owed_since = now
        self.tokens_owed += tokens
        self.used_at = max(self.used_at, now)

    # -- settling --------------------------------------------------------------------------------------

    def target(self, now: float, round_trip_s: float) -> int:
        """The units worth holding: this holder's demand over the horizon a renewal needs."""
        horizon = max(MIN_HORIZON_S, HORIZON_ROUND_TRIPS * round_trip_s)
        return round(self.demand_now(now) * horizon)

    def low(self, rpm: int, now: float, round_trip_s: float) -> bool:
        """Worth renewing now, ahead of need (and the authority may have units to give)."""
        if not rpm:
            return False
        target = self.target(now, round_trip_s)
        if target < 1 or self.held * 2 > target:
            return False
        shared = self.requests_now(rpm, now)
        return shared is None or shared >= 1.0

    def borrowed(self, now: float) -> None:
        """The stand-in admitted a request of this key: the authority will be told (`Ask.spent`)."""
        if not self.spent and not self.tokens_owed:
            self.owed_since = now
        self.spent += 1

    def due(self, rpm: int, tpm: int, now: float, *, flush_s: float) -> bool:
        """Has something to settle in the background: charges, idle units, a stale view."""
        if (self.tokens_owed or self.spent) and now - self.owed_since >= flush_s:
            return True
        if self.held and now - self.used_at > IDLE_RETURN_S:
            return True
        return now - self.used_at < REFRESH_S and now - self.settled_at > REFRESH_S

    def forgettable(self, now: float) -> bool:
        return (not self.held and not self.spent and not self.tokens_owed and not self.waiting
                and now - self.used_at > FORGET_S)

    def ask(self, key: str, rpm: int, tpm: int, now: float, round_trip_s: float) -> Ask:
        """What to send now (the held units it returns and the tokens it reports leave the lease)."""
        returned = 0
        want = 0
        if rpm:
            if self.held and not self.waiting and now - self.used_at > IDLE_RETURN_S:
                returned, self.held = self.held, 0
            else:
                want = max(0, self.waiting + self.target(now, round_trip_s) - self.held)
        tokens, self.tokens_owed = self.tokens_owed, 0
        # a holder owes at most its share of one burst: beyond it, what its stand-in admitted is what
        # the authority's own bucket could not have kept either (it stops refilling when full)
        spent, self.spent = min(self.spent, math.ceil(rpm / max(self.holders, 1))), 0
        self.settled_at = now
        return Ask(key, rpm, tpm, want, returned, tokens, spent)

    def answered(self, grant: Grant, now: float) -> None:
        self.held += grant.granted
        self.requests, self.tokens = grant.requests, grant.tokens
        self.seen_at, self.holders = now, grant.holders

    def unanswered(self, ask: Ask) -> None:
        """The settle failed: the tokens and units spent are still owed (the units it returned are
        lost to the authority for now: at worst a few units fewer, never more)."""
        self.tokens_owed += ask.tokens
        self.spent += ask.spent
