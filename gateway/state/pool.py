"""The only mutable backend state: health, outlier ejection, in-flight counts, scraped load, and
which backends a discovery pool has now.

Everything else reads it through immutable snapshots. Time comes in as arguments (`now`), never from
a clock read here, so outlier ejection (`outliers`) is testable without sleeping.

Discovered backends (`state.membership` brings them) join and leave a running pool: one that joins
is routable only after a passing probe; one that leaves is first *draining* (out of every route at
once, its in-flight requests finish), then removed. Routes and A/B arms may name a discovery pool;
`expand` replaces such a name with the pool's current members. A probe, scrape or verdict that
arrives for a backend already removed is ignored.

Backends are one set here, but requests choose from parts of it: a route's backends, an A/B arm's
(`CandidateSet`, from the generation's settings; a set naming a discovery pool follows its members
as they join and leave). The outlier guards ("never the last routable backend", "at most
`max_ejected_share` ejected") are judged in each set the backend belongs to, never over the whole
pool: with two routes of one backend each, neither backend can be ejected, although half the pool
could be.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from backends.base import Adapter, Load
from backends.ranks import RankPin, rank_pin

from ..rank_settings import unit_name
from ..routing.base import BackendView, Snapshot
from ..settings import Backend, Route
from .outliers import KEEP, OutlierRules, Record, Verdict, eject, fault, may_eject, readmit

STATIC: Final = "static"  # the `source` of a backend from the config's `backends:` list
NAMED: Final = 4  # backends a no-healthy-backend message describes one by one


@dataclass(frozen=True, slots=True)
class CandidateSet:
    """What one request chooses from: a route's backends, or an A/B arm's. `names` may name
    discovery pools (`Pool.expand`); `label` names the set in messages."""

    label: str
    names: tuple[str, ...]


def candidate_sets(routes: Iterable[Route]) -> list[CandidateSet]:
    """Every route's candidates (all its arms' backends for a split route) and every arm's."""
    sets = []
    for route in routes:
        sets.append(CandidateSet(f"route `{route.model}`", tuple(route.candidates)))
        if route.split is not None:
            sets += [CandidateSet(f"arm `{arm.name}` of route `{route.model}`", tuple(arm.backends))
                     for arm in route.split.arms]
    return sets


@dataclass(slots=True)
class BackendState:
    config: Backend
    adapter: Adapter
    probe_ok: bool = True  # optimistic until the first probe says otherwise
    ejected: bool = False
    outliers: Record = field(default_factory=Record)
    ejections: int = 0  # ever
    in_flight: int = 0
    load: Load = field(default_factory=Load)
    load_scraped_at: float | None = None
    probed_at: float | None = None
    last_error: str | None = None
    ejection_reason: str = ""  # what the rules saw when they last ejected it
    source: str = STATIC  # or the discovery entry that found it
    draining: bool = False  # discovery lost it: no new requests; it leaves once none is in flight
    draining_since: float | None = None
    max_model_len: int | None = None  # from the backend's own /v1/models (`model_cards`), when it says
    card_scraped_at: float | None = None
    name: str = field(init=False)  # the config's, read once: the request path reads these on every request
    runtime: str = field(init=False)
    base_url: str = field(init=False)
    # data-parallel ranks (`Backend.data_parallel_size`): each is a routing unit with its own name
    # (`units`) and in-flight count; a backend of one rank has neither (it is its own unit)
    units: tuple[str, ...] = field(init=False)
    rank_in_flight: list[int] = field(init=False)
    pin: RankPin | None = field(init=False)  # how a request is pinned to one of the ranks

    def __post_init__(self) -> None:
        self.name = self.config.name
        self.runtime = self.config.runtime.value
        self.base_url = self.config.base_url
        size = self.config.data_parallel_size
        self.units = tuple(unit_name(self.name, r) for r in range(size)) if size > 1 else ()
        self.rank_in_flight = [0] * len(self.units)
        self.pin = rank_pin(self.config.runtime, self.config.dp_rank_field) if self.units else None

    @property
    def healthy(self) -> bool:
        return self.probe_ok and not self.ejected and not self.draining

    @property
    def consecutive_failures(self) -> int:
        return self.outliers.consecutive_failures

    @property
    def ejected_until(self) -> float | None:
        return self.outliers.ejected_until

    def rank_views(self, output_tokens_per_s: float | None = None) -> list[BackendView]:
        """One view per data-parallel rank: the rank's load where the engine breaks it down (else
        unknown), the backend's health, its price and measured throughput shared evenly."""
        load = self.load
        per_rank = load.per_rank
        n = len(self.units)
        price = self.config.usd_per_hour
        share = None if price is None else price / n
        tps = None if output_tokens_per_s is None else output_tokens_per_s / n
        healthy = self.healthy
        runtime = self.config.runtime
        out = []
        for r, unit in enumerate(self.units):
            rl = per_rank[r] if r < len(per_rank) else _UNKNOWN
            out.append(BackendView(unit, runtime, healthy, self.rank_in_flight[r], rl.waiting, rl.running, rl.kv_usage,
                                   share, block_size=load.block_size, output_tokens_per_s=tps, backend=self.name,
                                   rank=r))
        return out

    def view(self, output_tokens_per_s: float | None = None) -> BackendView:
        load = self.load
        return BackendView(
            name=self.config.name,
            runtime=self.config.runtime,
            healthy=self.healthy,
            in_flight=self.in_flight,
            waiting=load.waiting,
            running=load.running,
            kv_usage=load.kv_usage,
            usd_per_hour=self.config.usd_per_hour,
            block_size=load.block_size,
            output_tokens_per_s=output_tokens_per_s,
        )


_UNKNOWN: Final = Load()


def _unit_views(states: dict[str, BackendState], names: Iterable[str],
                throughput: Callable[[str], float | None] | None) -> tuple[BackendView, ...]:
    """The routing units of `names`: a backend's own view, or one view per data-parallel rank."""
    out: list[BackendView] = []
    for n in names:
        s = states[n]
        tps = throughput(n) if throughput is not None else None
        if s.units:
            out.extend(s.rank_views(tps))
        else:
            out.append(s.view(tps))
    return tuple(out)


class Pool:
    """Backend states by name, plus the outlier-ejection rule (`outliers`).

    A backend is ejected on consecutive failures or on its failure rate over a window of completed
    requests, for longer on each repeat, unless that breaks a guard of one of its candidate sets;
    after that a passing health probe re-admits it.
    """

    def __init__(
        self, states: Iterable[BackendState], *, rules: OutlierRules | None = None, groups: Iterable[str] = (),
        sets: Iterable[CandidateSet] | None = None,
    ) -> None:
        """`groups`: the discovery pools routes may name (members are the states whose `source` is one).
        `sets`: the candidate sets requests choose from (`candidate_sets` of the routes; a backend in
        none gets no requests and is not guarded); None: the whole pool is one set."""
        self._states = {s.name: s for s in states}
        self.rules = rules if rules is not None else OutlierRules()
        self._sets = list(sets) if sets is not None else None
        self._groups: dict[str, list[str]] = {g: [] for g in groups}
        for s in self._states.values():
            if s.source in self._groups and not s.draining:
                self._groups[s.source].append(s.name)
        self._expanded: dict[tuple[str, ...], list[str]] = {}
        self._wide = any(s.units for s in self._states.values())  # some backend has data-parallel ranks

    def __getitem__(self, name: str) -> BackendState:
        return self._states[name]

    def __iter__(self) -> Iterator[BackendState]:
        return iter(self._states.values())

    def __len__(self) -> int:
        return len(self._states)

    def snapshot(self, names: Iterable[str], throughput: Callable[[str], float | None] | None = None) -> Snapshot:
        """Frozen views of `names`; `throughput(name)` supplies measured output tokens/s (for cost)."""
        states = self._states
        if self._wide:
            return Snapshot(_unit_views(states, names, throughput))
        if throughput is None:
            return Snapshot(tuple(states[n].view() for n in names))
        return Snapshot(tuple(states[n].view(throughput(n)) for n in names))

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self._states.values())

    def expand(self, names: Sequence[str]) -> list[str]:
        """Backend names (a route's or an arm's) with every discovery pool's name replaced by the
        pool's current members, in order; draining backends are no longer members."""
        if not self._groups:
            return names if isinstance(names, list) else list(names)
        key = tuple(names)
        expanded = self._expanded.get(key)
        if expanded is None:
            groups = self._groups
            expanded = self._expanded[key] = [m for n in key for m in groups.get(n, (n,))]
        return expanded

    def healthy_names(self) -> set[str]:
        """Healthy backends, and the discovery pools that have a healthy member (for A/B arms, whose
        backends may name pools)."""
        states = self._states
        healthy = {s.name for s in states.values() if s.healthy}
        healthy.update(g for g, members in self._groups.items() if any(states[m].healthy for m in members))
        return healthy

    def groups(self) -> dict[str, list[str]]:
        """Each discovery pool's current members (a copy)."""
        return {g: list(members) for g, members in self._groups.items()}

    def join(self, state: BackendState) -> BackendState | None:
        """Add a discovered backend to its pool (`state.source`); it gets requests once `probe_ok`.
        A draining backend of that name and pool comes back instead (not routable until its next
        passing probe). Returns the state that joined, or None when the name belongs to another."""
        group = self._groups.get(state.source)
        if group is None:
            return None
        existing = self._states.get(state.name)
        if existing is not None:
            if existing.source != state.source or not existing.draining:
                return None
            existing.draining = False
            existing.draining_since = None
            existing.probe_ok = False
            state = existing
        else:
            self._states[state.name] = state
            self._wide = self._wide or bool(state.units)
        group.append(state.name)
        self._expanded.clear()
        return state

    def drain(self, name: str, now: float) -> BackendState | None:
        """Take a discovered backend out of its pool: no new requests; the ones in flight finish."""
        state = self._states.get(name)
        if state is None or state.draining or state.source not in self._groups:
            return None
        state.draining = True
        state.draining_since = now
        self._groups[state.source].remove(name)
        self._expanded.clear()
        return state

    def remove(self, name: str) -> BackendState | None:
        """Forget a draining backend (its last request has finished, or it overran the drain)."""
        state = self._states.get(name)
        if state is None or not state.draining:
            return None
        del self._states[name]
        return state

    def judge(self, name: str, ok: bool, now: float, error: str | None = None) -> Verdict:
        """Record a completed request's verdict on its backend; ejects it when the rules say so."""
        state = self._states.get(name)
        if state is None:
            return KEEP
        if not ok:
            state.last_error = error
        reason = fault(state.outliers, ok, now, self.rules)
        if not reason:
            return KEEP
        guard = self._guarded_by(name)
        if guard:
            return Verdict(spared=True, reason=f"{reason}, but {guard}")
        state.ejected = True
        state.ejections += 1
        state.ejection_reason = reason
        return Verdict(eject_for_s=eject(state.outliers, now, self.rules), reason=reason)

    def _guarded_by(self, name: str) -> str:
        """Why ejecting `name` now would break a guard of one of its candidate sets ("" when none)."""
        states = self._states
        if self._sets is None:
            sets = [("the gateway", list(states))]
        else:
            sets = [(c.label, self.expand(c.names)) for c in self._sets]
        share = self.rules.max_ejected_share
        for label, names in sets:
            members = dict.fromkeys(n for n in names if n in states)  # a backend named twice is one member
            if name not in members:
                continue
            others = [states[n] for n in members if n != name]
            routable = sum(s.healthy for s in others)
            ejected = sum(s.ejected for s in others)
            if not may_eject(len(members), ejected_others=ejected, routable_others=routable,
                             max_ejected_share=share):
                if not routable:
                    return f"{label} would have no routable backend left"
                return f"{label} would have more than {share:.0%} of its {len(members)} backends ejected"
        return ""

    def unavailable(self, names: Sequence[str], now: float) -> tuple[str, float]:
        """Why none of `names` (backends) takes requests, one clause per backend (an ejected one's
        with what ejected it and its last failure), and the seconds until the first of those
        ejections ends (1 when one is out for another reason: a probe may bring it back any time)."""
        clauses = []
        back_in: float | None = None
        other = False
        for n in names:
            s = self._states.get(n)
            if s is None or s.healthy:
                continue
            if s.ejected:
                left = max(0.0, (s.ejected_until or now) - now)
                back_in = left if back_in is None else min(back_in, left)
                clauses.append(f"`{n}` is ejected ({s.ejection_reason}; last failure: {s.last_error or 'unknown'}) "
                               + (f"for {left:.0f} s more" if left >= 1 else "until its next passing health probe"))
                continue
            other = True
            if s.draining:
                clauses.append(f"`{n}` is leaving (its discovery no longer lists it)")
            elif s.probed_at is None:
                clauses.append(f"`{n}` has not passed a health probe yet")
            else:
                clauses.append(f"`{n}` fails its health probe ({s.last_error or 'not ready'})")
        if not clauses:
            text = "it has no backend yet" if not names else "none is available"
        else:
            text = "; ".join(clauses[:NAMED]) + (f"; and {len(clauses) - NAMED} more" if len(clauses) > NAMED else "")
        return text, 1.0 if other or back_in is None else max(1.0, back_in)

    def record_probe(self, name: str, ok: bool, now: float, error: str | None = None) -> None:
        state = self._states.get(name)
        if state is None:
            return
        state.probe_ok = ok
        state.probed_at = now
        if not ok:
            state.last_error = error
        elif state.ejected and readmit(state.outliers, now):
            state.ejected = False

    def record_load(self, name: str, load: Load, now: float) -> None:
        state = self._states.get(name)
        if state is None:
            return
        state.load = load
        state.load_scraped_at = now
