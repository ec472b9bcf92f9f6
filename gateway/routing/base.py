"""The values a routing policy sees and returns. Policies are pure: no I/O, no clock, no globals."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from backends.base import Runtime


@dataclass(frozen=True, slots=True)
class BackendView:
    """What a policy may know about one backend, frozen at snapshot time."""

    name: str
    runtime: Runtime
    healthy: bool
    in_flight: int
    waiting: float | None  # engine-reported queue; None when the engine does not say
    running: float | None
    kv_usage: float | None
    usd_per_hour: float | None

    @property
    def load_score(self) -> float:
        """One comparable load number: what we have in flight plus what the engine says is queued."""
        return self.in_flight + (self.waiting or 0.0)


@dataclass(frozen=True, slots=True)
class Snapshot:
    backends: tuple[BackendView, ...]

    def healthy(self, exclude: frozenset[str] = frozenset()) -> tuple[BackendView, ...]:
        return tuple(b for b in self.backends if b.healthy and b.name not in exclude)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The routing-relevant description of a request."""

    model: str
    seq: int  # a per-route request counter, so round robin stays a pure function
    exclude: frozenset[str] = frozenset()  # backends already tried for this request


@dataclass(frozen=True, slots=True)
class Decision:
    backend: str
    reason: str  # low-cardinality: "round_robin", "least_load", ...


class Policy(Protocol):
    name: str

    def choose(self, req: RouteRequest, snapshot: Snapshot, rng: random.Random) -> Decision | None:
        """The backend for `req`, or None when no candidate is healthy."""
        ...
