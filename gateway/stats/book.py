"""The stats book: every finished request, filed into the groups the comparison reports on.

Groups are fixed by the config (each backend, each data-parallel rank of a backend that has ranks,
each runtime, each A/B arm of each split route, and the whole gateway), so label-like cardinality
and memory are bounded no matter what clients send.
Embedding models are not generation: the backends of `embeddings` routes have their own runtime
groups (`vllm/embeddings`, ...) and stay out of the whole gateway's figures, and tokenize requests
are not filed at all (they run no engine work worth comparing).
Discovered backends get groups while they are in the pool (`reconfigure(..., backends=, pools=)`);
one that left is kept aside while the composition root says so (`keep=`: its discovery entry's
`remember_s`), out of every report, and comes back with its history if it returns meanwhile.
The book reads no clock: each Outcome carries `finished_at` (the Recorder stamps it with the app's
clock) and each query is given `now`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final

from ..observability.outcome import NONE, Outcome
from ..rank_settings import unit_name
from ..settings import Backend, Settings
from .window import Sample, Series

WeightsFn = Callable[[str], Mapping[str, float]]
UNFILED: Final = frozenset({"tokenize", "detokenize"})
MAX_PAIRS: Final = 1024  # pair groups per book: config names bound them; this bounds a misconfigured fleet


def pair_name(prefill: str | None, decode: str) -> str:
    """A prefill/decode pair's group name: `<prefill>><decode>` (`none>` when no prefill answered)."""
    return f"{prefill or 'none'}>{decode}"


def leg_sample(o: Outcome) -> Sample:
    """A split request's leg times as a sample of its pair's `pair_legs` group: `e2e_s` is the
    prefill leg's time, `ttft_s` the transfer time (prefill end to the decode's first token)."""
    return Sample(at=o.finished_at, error=is_error(o.status), prompt_tokens=0, completion_tokens=0, cached_tokens=0,
                  ttft_s=o.transfer_s, gaps=None, tpot_s=None, e2e_s=o.prefill_s or 0.0, sla=None, generation_s=None)


def runtime_group(runtime: str, embeddings: bool) -> str:
    """The runtime group's name: the runtime's, or `<runtime>/embeddings` for embedding models."""
    return f"{runtime}/embeddings" if embeddings else runtime


@dataclass(frozen=True, slots=True)
class Group:
    """What a group is (for reports and pricing) and its windows."""

    kind: str  # "backend" | "rank" | "runtime" | "arm" | "total"
    name: str
    backends: tuple[str, ...]
    runtime: str | None
    route: str | None
    series: Series
    task: str = "generate"  # or "embeddings": what the group's backends serve


def configured_weights(settings: Settings) -> WeightsFn:
    """The split weights as configured; the default source of `weights` when nothing changes them live."""
    table = {
        r.model: {a.name: a.weight for a in r.split.arms} for r in settings.routes if r.split is not None
    }
    return lambda model: table.get(model, {})


def is_error(status: str) -> bool:
    """Errors for the error rate: anything but 2xx, except a client that hung up (not the backend's fault)."""
    return not status.startswith("2") and status != "client_closed"


def to_sample(o: Outcome) -> Sample:
    usage = o.usage
    prompt = usage.prompt_tokens if usage else 0
    completion = usage.completion_tokens if usage else 0
    tpot = None
    if o.ttft_s is not None and completion > 1:
        tpot = max(o.duration_s - o.ttft_s, 0.0) / (completion - 1)
    return Sample(
        at=o.finished_at, error=is_error(o.status), prompt_tokens=prompt, completion_tokens=completion,
        cached_tokens=(usage.cached_tokens or 0) if usage else 0, ttft_s=o.ttft_s, gaps=o.gaps,
        tpot_s=tpot, e2e_s=o.duration_s, sla=o.sla, generation_s=o.generation_s,
    )


class StatsBook:
    def __init__(
        self, settings: Settings, *, started_at: float, weights: WeightsFn | None = None, seed: int = 0
    ) -> None:
        self.settings = settings
        self.started_at = started_at
        self.weights: WeightsFn = weights if weights is not None else configured_weights(settings)
        self._rng = random.Random(seed)
        self._advanced_s: int | None = None  # the second the groups were last advanced to by `record`
        self.backends: dict[str, Group] = {}
        self.ranks: dict[str, Group] = {}  # by unit name (`<backend>@<rank>`): a wide server's ranks
        self.absent: dict[str, Group] = {}  # backends that left, kept for their return (`reconfigure(keep=)`)
        self.runtimes: dict[str, Group] = {}
        self.arms: dict[tuple[str, str], Group] = {}
        # prefill/decode disaggregation, by (route, name): each pair (true TTFT and throughput), its leg
        # times (`leg_sample`), and each topology (`split`, `whole`) of a disaggregated route
        self.pairs: dict[tuple[str, str], Group] = {}
        self.pair_legs: dict[tuple[str, str], Group] = {}
        self.topologies: dict[tuple[str, str], Group] = {}
        self.total = self._group("total", "all", [b.name for b in settings.backends
                                                  if b.name not in settings.embedding_backends])
        self.reconfigure(settings)

    def _group(self, kind: str, name: str, backends: list[str], runtime: str | None = None,
               route: str | None = None, task: str = "generate") -> Group:
        return Group(kind, name, tuple(backends), runtime, route, Series(self.started_at, self._rng), task)

    def reconfigure(
        self, settings: Settings, *, backends: Sequence[Backend] | None = None,
        pools: Mapping[str, Sequence[str]] | None = None, keep: Collection[str] = (),
    ) -> None:
        """Adopt a (re)loaded config, or a change of discovered backends: groups for new backends,
        runtimes and arms start empty; existing ones keep their history (a backend is identified by
        its name), with membership and prices updated. Groups no longer there are dropped, except
        the backend groups named in `keep`: set aside (in no report), and back with their history
        when their backend is listed again.

        `backends` are the pool's (default: the config's static ones); `pools` maps each discovery
        pool that an arm may name to its current members."""
        self.settings = settings
        listed = list(settings.backends) if backends is None else list(backends)
        pools = pools or {}

        def expand(names: Sequence[str]) -> tuple[str, ...]:
            return tuple(m for n in names for m in pools.get(n, (n,)))

        embedding = frozenset(expand(sorted(settings.embedding_backends)))
        self.prices = {b.name: b.usd_per_hour for b in listed}
        backends_now = {}
        known = {**self.absent, **self.backends}
        for b in listed:
            old = known.get(b.name)
            task = "embeddings" if b.name in embedding else "generate"
            backends_now[b.name] = (replace(old, task=task) if old is not None
                                    else self._group("backend", b.name, [b.name], b.runtime.value, task=task))
        self.backends = backends_now
        ranks_now = {}
        for b in listed:
            for dp_rank in range(b.data_parallel_size if b.data_parallel_size > 1 else 0):
                unit = unit_name(b.name, dp_rank)
                old_rank = self.ranks.get(unit)
                # no backends of its own: the server's price is its row's, not each rank's
                ranks_now[unit] = old_rank if old_rank is not None else self._group(
                    "rank", unit, [], b.runtime.value)
        self.ranks = ranks_now
        self.absent = {n: g for n, g in known.items() if n in keep and n not in backends_now}
        members: dict[str, list[str]] = {}
        for b in listed:
            members.setdefault(runtime_group(b.runtime.value, b.name in embedding), []).append(b.name)
        runtimes = {}
        for name, names in members.items():
            old_rt = self.runtimes.get(name)
            rt, _, task = name.partition("/")
            runtimes[name] = (replace(old_rt, backends=tuple(names)) if old_rt is not None
                              else self._group("runtime", name, names, rt, task=task or "generate"))
        self.runtimes = runtimes
        arms: dict[tuple[str, str], Group] = {}
        for r in settings.routes:
            if r.split is not None:
                for a in r.split.arms:
                    old_arm = self.arms.get((r.model, a.name))
                    arm_backends = expand(a.backends)
                    arms[(r.model, a.name)] = (replace(old_arm, backends=arm_backends) if old_arm is not None
                                               else self._group("arm", a.name, list(arm_backends), route=r.model))
        self.arms = arms
        priced = set(self.prices)
        disaggregated = {r.model for r in settings.routes if r.disaggregates}
        self.pairs = {k: g for k, g in self.pairs.items() if k[0] in disaggregated and set(g.backends) <= priced}
        self.pair_legs = {k: g for k, g in self.pair_legs.items() if k in self.pairs}
        self.topologies = {k: g for k, g in self.topologies.items() if k[0] in disaggregated}
        self.total = replace(self.total, backends=tuple(b.name for b in listed if b.name not in embedding))

    def peak_output_tps(self, backend: str) -> float | None:
        """`backend`'s best output tokens/s, for the cost policy: the 90th percentile of its busy 10-s
        spans of the last hour, each scored a minute after it ended (`peak`); None = unknown. It is
        current as of the last request that finished anywhere in the gateway (or the last query)."""
        group = self.backends.get(backend)
        return group.series.peak_output_tps if group is not None else None

    def record(self, o: Outcome) -> None:
        """File `o` into its groups. Once per second of the clock, every group is advanced first, so
        the best-throughput figures of backends that get no traffic still age."""
        if o.endpoint in UNFILED:
            return
        sample = to_sample(o)
        second = math.floor(o.finished_at)
        if second != self._advanced_s:
            self._advanced_s = second
            self.advance(o.finished_at)
        embeddings = o.endpoint == "embeddings"
        targets = [] if embeddings else [self.total]
        if o.backend != NONE and o.backend in self.backends:
            targets.append(self.backends[o.backend])
            if o.rank is not None:
                rank = self.ranks.get(unit_name(o.backend, o.rank))
                if rank is not None:
                    targets.append(rank)
            rt = self.runtimes.get(runtime_group(o.runtime, embeddings))
            if rt is not None:
                targets.append(rt)
        if o.arm is not None:
            arm = self.arms.get((o.model, o.arm))
            if arm is not None:
                targets.append(arm)
        if o.topology is not None and not embeddings:
            self._file_pd(o, targets)
        for g in targets:
            g.series.add(sample)

    def _file_pd(self, o: Outcome, targets: list[Group]) -> None:
        topology = self.topologies.get((o.model, o.topology or ""))
        if topology is None and o.topology in ("split", "whole"):
            topology = self.topologies[(o.model, o.topology)] = self._group("topology", o.topology, [], route=o.model)
        if topology is not None:
            targets.append(topology)
        if o.topology != "split" or o.backend not in self.backends:
            return
        key = (o.model, pair_name(o.prefill, o.backend))
        pair = self.pairs.get(key)
        if pair is None:
            if len(self.pairs) >= MAX_PAIRS or (o.prefill is not None and o.prefill not in self.backends):
                return
            members = [o.backend] if o.prefill is None else [o.prefill, o.backend]
            pair = self.pairs[key] = self._group("pair", key[1], members, o.runtime, route=o.model)
            self.pair_legs[key] = self._group("pair_legs", key[1], members, o.runtime, route=o.model)
        targets.append(pair)
        if o.prefill_s is not None:
            self.pair_legs[key].series.add(leg_sample(o))

    def all_groups(self) -> list[Group]:
        return [*self.backends.values(), *self.ranks.values(), *self.runtimes.values(), *self.arms.values(),
                *self.pairs.values(), *self.pair_legs.values(), *self.topologies.values(), self.total]

    def advance(self, now: float) -> None:
        for g in self.all_groups():
            g.series.advance(now)
