"""Per-key rate limits: token buckets in requests and in tokens per minute, on an injected clock.

A request takes one unit from its key's request bucket when it arrives. Tokens are only known after
the request (from its usage), so they are charged then and may drive the token bucket below zero;
the next request is admitted again once it has refilled above zero. Both answers say how long to wait.

`KeyLimiter` holds the buckets of one process. A gateway of several workers keeps its buckets in the
supervisor (`cluster.hub`, asked over the worker's channel) and a fleet of replicas in the shared
store (`access.shared_limits`); all of them are a `Limiter`, and all keep these semantics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
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


class Limiter(Protocol):
    async def admit(self, key: KeyLimits) -> Admission: ...

    def charge(self, key: KeyLimits, tokens: int) -> None: ...


@dataclass(slots=True)
class Bucket:
    capacity: float
    per_s: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.per_s)
        self.updated = now

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
        if bucket is None or bucket.capacity != per_minute:  # new key, or its limit changed on reload
            bucket = store[key_id] = Bucket(float(per_minute), per_minute / 60.0, float(per_minute), now)
        bucket.refill(now)
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

    def charge(self, key: KeyLimits, tokens: int) -> None:
        if key.tokens_per_minute is None or tokens <= 0:
            return
        bucket = self._bucket(self._tokens, key.id, key.tokens_per_minute, self._clock())
        bucket.level -= tokens


class LocalLimiter:
    """This process's buckets as a `Limiter`."""

    def __init__(self, limiter: KeyLimiter) -> None:
        self.buckets = limiter

    async def admit(self, key: KeyLimits) -> Admission:
        return self.buckets.admit(key)

    def charge(self, key: KeyLimits, tokens: int) -> None:
        self.buckets.charge(key, tokens)
