"""The two baseline policies: round robin and least load (power of two choices)."""

from __future__ import annotations

import random

from .base import Decision, RouteRequest, Snapshot


class RoundRobin:
    """Cycles through the healthy candidates by the route's request counter."""

    name = "round_robin"

    def choose(self, req: RouteRequest, snapshot: Snapshot, rng: random.Random) -> Decision | None:
        candidates = snapshot.healthy(req.exclude)
        if not candidates:
            return None
        return Decision(candidates[req.seq % len(candidates)].name, self.name)


class LeastLoad:
    """Power of two choices on in-flight requests plus the engine-reported queue.

    Sampling two candidates (instead of scanning for the global minimum) avoids the herd effect of
    many concurrent decisions taken on the same, slightly stale snapshot, while keeping the maximum
    load exponentially closer to the mean than random choice.
    """

    name = "least_load"

    def choose(self, req: RouteRequest, snapshot: Snapshot, rng: random.Random) -> Decision | None:
        candidates = snapshot.healthy(req.exclude)
        if not candidates:
            return None
        if len(candidates) == 1:
            return Decision(candidates[0].name, self.name)
        # two distinct candidates from two draws of `random()` (C), not `rng.sample` (interpreted Python)
        n = len(candidates)
        i = int(rng.random() * n)
        j = int(rng.random() * (n - 1))
        a, b = candidates[i], candidates[j + 1 if j >= i else j]
        best = a if a.load_score <= b.load_score else b
        return Decision(best.name, self.name)

