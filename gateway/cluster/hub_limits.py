"""The hub's limit role: the buckets of every key for the whole host, leased to its workers.

A worker never asks the hub on a request: it holds a lease on each key it serves and settles it in
the background (`access.leased`, the rules in `access.leases`), so the hub's one event loop (probe
rounds, metric and window merges, fleet publishing) can stall without holding up admissions, and a
stalled hub makes each worker decide on its share of the budget (`access.leased.ShareLimiter`), not
on a whole budget each. With a store, workers lease from Redis directly; these buckets are then what
they fall back to while the store is down (the host's budget, as for a replica on its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..access.leases import Ask, Authority


class HostLimits:
    """The `settle` call of the hub's channel: a worker's asks, answered from the host's buckets."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.authority = Authority()

    def settle(self, body: list[Any]) -> list[list[object]]:
        holder, asks = body
        now = self._clock()
        return [self.authority.settle(str(holder), Ask.decode(raw), now).encode() for raw in asks]
