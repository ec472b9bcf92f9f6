"""`cost`: the cheapest live cost per output token among backends that are not overloaded.

Cost per output token is `usd_per_hour / (3600 * output_tokens_per_s)` with the backend's measured
recent throughput, so a pricier but much faster backend can be the cheaper one. Backends over the
load bound (`load_factor` x mean + `slack`) are not acceptable, so the cheapest backend fills up to
the bound and the next cheapest takes the overflow, instead of everything queueing on the cheapest.
Ranking: known cost before unknown, cost (5% bands), then the expected prefix hit (shared scorer),
then load, then the rendezvous score -> reason "cost".
"""

from __future__ import annotations

import random

from .base import Decision, RouteRequest, Snapshot
from .scoring import LoadBounded, cost_rank, hits_for, pick


class Cost(LoadBounded):
    """Lowest cost per output token under the load bound."""

    name = "cost"

    def choose(self, req: RouteRequest, snapshot: Snapshot, rng: random.Random) -> Decision | None:
        candidates = snapshot.healthy(req.exclude)
        if not candidates:
            return None
        bound = self.bound(candidates)
        acceptable = [v for v in candidates if v.load_score <= bound]  # never empty: min <= mean
        features = req.features
        hits = dict(zip((v.name for v in acceptable), hits_for(snapshot, features, acceptable), strict=True))
        best = pick(acceptable, lambda v: (*cost_rank(v), -hits[v.name], v.load_score), features.affinity_key)
        return Decision(best.name, "cost", hits[best.name])
