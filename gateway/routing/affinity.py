"""`prefix_affinity`: send a prompt where its prefix is cached, without letting a hot prefix snowball.

1. Expected hit per candidate from the prefix index (chained block hashes, engine granularity).
2. Some hit: rank by (longest hit, lowest load, rendezvous score) -> reason "affinity".
3. No hit anywhere: rank by rendezvous score of the request's affinity key (x-prefix-key, else
   x-session-id, else the first prompt block) -> reason "hash". Every replica and worker ranks a
   new prefix alike without sharing state, and removing a backend remaps only the keys that ranked
   it first.
4. Bounded load (consistent hashing with bounded loads): a candidate whose load exceeds
   `load_factor` x mean + `slack` is skipped and we walk down the ranking -> reason "spill". Hit
   holders come first, then the least loaded of the rest, which then caches the prefix too: a hot
   prefix spreads instead of becoming the cache-hit "death spiral" where one backend gets all the
   traffic.
5. No key at all (a prompt shorter than one block, no hints): least load -> "least_load".
"""

from __future__ import annotations

import random

from .base import Decision, RouteRequest, Snapshot
from .hashing import hrw
from .scoring import LoadBounded, by_rendezvous, hits_for, least_loaded, walk


class PrefixAffinity(LoadBounded):
    """Longest expected prefix hit, rendezvous placement for new prefixes, bounded-load spill."""

    name = "prefix_affinity"

    def choose(self, req: RouteRequest, snapshot: Snapshot, rng: random.Random) -> Decision | None:
        candidates = snapshot.healthy(req.exclude)
        if not candidates:
            return None
        features = req.features
        key = features.affinity_key
        loads = [v.load_score for v in candidates]
        bound = self.bound(candidates)
        hits = hits_for(snapshot, features, candidates)
        if max(hits) > 0:
            k = features.chain[0] if key is None else key  # describe always sets a key with a chain
            top = min(zip(hits, loads, strict=True), key=lambda hl: (-hl[0], hl[1]))
            ties = [i for i in range(len(candidates)) if hits[i] == top[0] and loads[i] == top[1]]
            first = ties[0] if len(ties) == 1 else max(ties, key=lambda i: hrw(k, candidates[i].name))
            if loads[first] <= bound:
                return Decision(candidates[first].name, "affinity", hits[first])
            order = sorted(range(len(candidates)), key=lambda i: (-hits[i], loads[i], -hrw(k, candidates[i].name)))
            holders = [i for i in order if hits[i] > 0]
            # a hot prefix spreads to the least loaded non-holder (rendezvous breaks ties), so it does not
            # pile onto the same "next" backend every time
            rest = sorted((i for i in order if hits[i] == 0), key=lambda i: (loads[i], -hrw(k, candidates[i].name)))
            chosen = next((i for i in holders + rest if loads[i] <= bound), first)  # min load <= bound
            return Decision(candidates[chosen].name, "spill", hits[chosen])
        if key is None:
            return Decision(least_loaded(candidates, None).name, "least_load")
        chosen_view, spilled = walk(by_rendezvous(candidates, key), lambda v: v.load_score <= bound)
        return Decision(chosen_view.name, "spill" if spilled else "hash")
