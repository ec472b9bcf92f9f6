"""SGLang's / SMG's `cache_aware` policy, re-implemented from its source for the virtual-time bench.

What it does (sgl-router `src/policies/cache_aware.rs`, SMG 1.x `model_gateway/src/policies/
cache_aware.rs`, the HTTP path: an approximate radix tree over the request text per worker):

1. The load of a worker is the router's own count of its requests in flight.
2. Imbalanced when `max - min > balance_abs_threshold` AND `max > balance_rel_threshold * min`:
   then the least loaded worker, whatever the cache (and the text is still inserted for it).
3. Otherwise the tree's longest prefix match over every worker's inserted texts; when
   matched / input characters > `cache_threshold`, the worker holding that match, else the least
   loaded worker. The chosen worker's tree gets the text inserted.

The CLI defaults (what `smg` / `sglang_router.launch_router` run with): cache threshold 0.3,
balance thresholds 64 / 1.5, a tree of 64M characters (so nothing is evicted in these runs).

Approximations: the tree is kept at the granularity of the gateway's 64-character hashing units
(`RequestFeatures.chain`: a running hash, so one element names the whole prefix up to it, which is
what a radix node is); a match shorter than 64 characters counts as none. The deepest node's
tenant is the one that inserted or matched it last (SMG takes the first of the node's tenant map,
an arbitrary order). Neither changes which worker a long shared prefix goes to.
"""

from __future__ import annotations

import random

from gateway.routing import Decision, RouteRequest, Snapshot

CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5


class CacheAware:
    """A stateful router policy (as SMG's is): `choose` inserts the request into its tree."""

    def __init__(self, *, cache_threshold: float = CACHE_THRESHOLD, balance_abs: float = BALANCE_ABS,
                 balance_rel: float = BALANCE_REL) -> None:
        self.name = f"cache_aware(abs={balance_abs:g})"
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._tree: dict[int, dict[str, int]] = {}  # prefix unit -> worker -> last access
        self._clock = 0

    def choose(self, req: RouteRequest, snapshot: Snapshot, rng: random.Random) -> Decision | None:
        views = snapshot.healthy(req.exclude)
        if not views:
            return None
        loads = [v.in_flight for v in views]  # the router's own in-flight count
        lo, hi = min(loads), max(loads)
        least = views[loads.index(lo)].name
        chain = req.features.chain
        self._clock += 1
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            self._insert(chain, least)
            return Decision(least, "imbalanced")
        depth, tenant = 0, None
        names = {v.name for v in views}
        for unit in chain:
            holders = self._tree.get(unit)
            live = {w: t for w, t in holders.items() if w in names} if holders else None
            if not live:
                break
            depth += 1
            tenant = max(live, key=lambda w: live[w])
        chars = max(1, req.features.prompt_bytes)
        if tenant is not None and depth * 64 / chars > self.cache_threshold:
            self._insert(chain, tenant)
            return Decision(tenant, "cache_hit", depth * 16)
        self._insert(chain, least)
        return Decision(least, "cache_miss")

    def _insert(self, chain: tuple[int, ...], worker: str) -> None:
        tick = self._clock
        tree = self._tree
        for unit in chain:
            node = tree.get(unit)
            if node is None:
                tree[unit] = {worker: tick}
            else:
                node[worker] = tick
