"""Per-key rate limits: token buckets in requests and in tokens per minute, on an injected clock.

A request takes one unit from its key's request bucket when it arrives. Tokens are only known after
the request (from its usage), so they are charged then and may drive the token bucket below zero;
the next request is admitted again once it has refilled above zero. Both answers say how long to wait.

`rate_headers` states a key's budgets the way OpenAI does, on every response to a key with limits
(`x-ratelimit-limit-*`, `x-ratelimit-remaining-*`, `x-ratelimit-reset-*` for requests and tokens:
the limit per minute, what is left now, and how long until the bucket is full again, as `1s`,
`6m0s`, `250ms`), from the bucket levels the admission saw.

`KeyLimiter` holds the buckets of one process. A gateway of several workers keeps its buckets in the
supervisor (`cluster.hub_limits`) and a fleet of replicas in the shared store
(`access.shared_limits`), and each process admits from leases on them (`access.leases`,
`access.leased`); all of them are a `Limiter` (an admission answers the decision and the levels it
left), and all keep these semantics. A key whose limit changes keeps its bucket's fraction
(`Bucket.rescaled`), wherever the bucket is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


class KeyLimits(Protocol):
    """What a limiter reads of a key (`settings.ApiKey` has it)."""

    @property
    def id(self) -> str: ...

    @property
    def requests_per_minute(self) -> int | None: ...

    @property
    def tokens_per_minute(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits without the key (what crosses a process boundary)."""

    id: str
    requests_per_minute: int | None
    tokens_per_minute: int | None


Admission = tuple[int, str] | None  # None: admitted; else (Retry-After seconds, "requests" | "tokens")


@dataclass(frozen=True, slots=True)
class Decision:
    """An admission's answer and the levels it left in the key's buckets ("requests", "tokens")."""

    refused: Admission = None
    levels: Mapping[str, float] = field(default_factory=dict)


class Limiter(Protocol):
    async def admit(self, key: KeyLimits) -> Decision: ...

    def charge(self, key: KeyLimits, tokens: int) -> None: ...


def _per_minute(key: KeyLimits, kind: str) -> int | None:
    return key.requests_per_minute if kind == "requests" else key.tokens_per_minute


def rate_headers(key: KeyLimits, levels: Mapping[str, float]) -> dict[str, str]:
    """OpenAI's rate-limit headers for `key` at these levels (empty for a key without limits)."""
    out: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        per_minute = _per_minute(key, kind)
        if per_minute is None:
            continue
        level = levels.get(kind, float(per_minute))
        out[f"x-ratelimit-limit-{kind}"] = str(per_minute)
        out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
        out[f"x-ratelimit-reset-{kind}"] = duration(max(per_minute - level, 0.0) / (per_minute / 60.0))
    return out


def exact_wait_s(key: KeyLimits, kind: str, levels: Mapping[str, float]) -> float:
    """Exact seconds until `kind`'s budget admits the next request (for `retry-after-ms`)."""
    per_minute = _per_minute(key, kind)
    if per_minute is None:
        return 0.0
    level, per_s = levels.get(kind, float(per_minute)), per_minute / 60.0
    if kind == "tokens":
        return 0.0 if level > 0 else -level / per_s
    return 0.0 if level >= 1.0 else (1.0 - level) / per_s


def fraction_now(level: float, capacity: float, elapsed_s: float) -> float:
    """How full a bucket is `elapsed_s` after it held `level` of `capacity` (at most 1; below 0 while
    tokens are overdrawn). A bucket refills its whole capacity in a minute whatever that capacity is,
    so the fraction grows by 1/60 a second: a capacity change keeps the fraction (`rescaled`)."""
    return min(1.0, level / capacity + max(elapsed_s, 0.0) / 60.0)


@dataclass(slots=True)
class Bucket:
    capacity: float
    per_s: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.per_s)
        self.updated = now

    def rescaled(self, capacity: float) -> None:
        """The key's limit changed (a reload, an `api_keys_file` re-read): keep the bucket as full as
        it was, as a fraction, never refill it. The same fraction is the same time until full, so a
        client that was told to wait is not let in early, and a limit that flips back and forth (two
        configs during a rolling deploy) neither drains nor refills the bucket."""
        self.level = self.level * capacity / self.capacity
        self.capacity, self.per_s = capacity, capacity / 60.0

    def wait_s(self, need: float) -> float:
        """Seconds until `need` units are available (0 when they are)."""
        return 0.0 if self.level >= need else (need - self.level) / self.per_s


class KeyLimiter:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._requests: dict[str, Bucket] = {}
        self._tokens: dict[str, Bucket] = {}

    @staticmethod
    def _bucket(store: dict[str, Bucket], key_id: str, per_minute: int, now: float) -> Bucket:
        bucket = store.get(key_id)
        if bucket is None:
            bucket = store[key_id] = Bucket(float(per_minute), per_minute / 60.0, float(per_minute), now)
        bucket.refill(now)
        if bucket.capacity != per_minute:  # its limit changed on reload: rescaled, never refilled
            bucket.rescaled(float(per_minute))
        return bucket

    def admit(self, key: KeyLimits) -> Admission:
        """Take one request for `key`; None when admitted, else the whole seconds to wait (Retry-After)
        and which budget is spent ("requests" or "tokens", as OpenAI names them)."""
        now = self._clock()
        waits = [(0.0, "requests")]
        requests = tokens = None
        if key.requests_per_minute is not None:
            requests = self._bucket(self._requests, key.id, key.requests_per_minute, now)
            waits.append((requests.wait_s(1.0), "requests"))
        if key.tokens_per_minute is not None:
            tokens = self._bucket(self._tokens, key.id, key.tokens_per_minute, now)
            waits.append((0.0 if tokens.level > 0 else max(-tokens.level / tokens.per_s, 1e-3), "tokens"))
        wait, kind = max(waits)
        if wait > 0:
            return max(1, math.ceil(wait)), kind
        if requests is not None:
            requests.level -= 1.0
        return None

    def levels(self, key: KeyLimits) -> dict[str, float]:
        """The key's bucket levels now ("requests", "tokens"; only the budgets it has)."""
        now = self._clock()
        out: dict[str, float] = {}
        for kind, store in (("requests", self._requests), ("tokens", self._tokens)):
            per_minute = _per_minute(key, kind)
            if per_minute is not None:
                out[kind] = self._bucket(store, key.id, per_minute, now).level
        return out

    def wait_s(self, key: KeyLimits, kind: str) -> float:
        """Exact seconds until `kind`'s budget admits the next request (for `retry-after-ms`)."""
        return exact_wait_s(key, kind, self.levels(key))

    def headers(self, key: KeyLimits) -> dict[str, str]:
        """OpenAI's rate-limit headers for `key` now (empty for a key without limits)."""
        return rate_headers(key, self.levels(key))

    def charge(self, key: KeyLimits, tokens: int) -> None:
        if key.tokens_per_minute is None or tokens <= 0:
            return
        bucket = self._bucket(self._tokens, key.id, key.tokens_per_minute, self._clock())
        bucket.level -= tokens


def duration(seconds: float) -> str:
    """A duration as OpenAI's rate-limit headers write it: `250ms`, `1s`, `6m0s`, `1h2m3.5s`."""
    if seconds < 1.0:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    ms = math.ceil(seconds * 1000)
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return out + f"{secs}s"


class LocalLimiter:
    """This process's buckets as a `Limiter`."""

    def __init__(self, limiter: KeyLimiter) -> None:
        self.buckets = limiter

    async def admit(self, key: KeyLimits) -> Decision:
        refused = self.buckets.admit(key)
        return Decision(refused, self.buckets.levels(key))

    def charge(self, key: KeyLimits, tokens: int) -> None:
        self.buckets.charge(key, tokens)
