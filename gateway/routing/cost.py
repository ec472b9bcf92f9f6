"""`cost`: the cheapest live cost per output token among backends that are not overloaded.

Cost per output token is `usd_per_hour / (3600 * output_tokens_per_s)` with the backend's measured
recent throughput, so a pricier but much faster backend can be the cheaper one. Backends over the
load bound (`load_factor` x mean + `slack`) are not acceptable, so the cheapest backend fills up to
the bound and the next cheapest takes the overflow, instead of everything queueing on the cheapest.
Ranking: known cost before unknown, cost (~20% bands, `scoring.COST_TIE`), then the expected prefix hit (shared scorer),
then load, then the rendezvous score -> reason "cost".
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .base import BackendView, Decision, RouteRequest, Snapshot
from .scoring import LoadBounded, argmin, cost_rank, hits_for


class Cost(LoadBounded):
    """Lowest cost per output token under the load bound."""

    name = "cost"

    def choose(self, req: RouteRequest, snapshot: Snapshot, rng: random.Random) -> Decision | None:
        candidates = snapshot.healthy(req.exclude)
        if not candidates:
            return None
        loads = [v.in_flight + (v.waiting or 0.0) for v in candidates]  # BackendView.load_score
        bound = self.load_factor * sum(loads) / len(loads) + self.slack  # LoadBounded.bound
        if max(loads) <= bound:
            acceptable: Sequence[BackendView] = candidates
        else:
            acceptable = [v for v, load in zip(candidates, loads, strict=True) if load <= bound]  # min <= mean
            loads = [load for load in loads if load <= bound]
        features = req.features
        hits = hits_for(snapshot, features, acceptable)
        ranks = [(*cost_rank(v), -hits[i], loads[i]) for i, v in enumerate(acceptable)]
        chosen = argmin(ranks, features.affinity_key, lambda i: acceptable[i].name)
        return Decision(acceptable[chosen].name, "cost", hits[chosen])
