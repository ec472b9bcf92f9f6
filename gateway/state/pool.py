"""The only mutable backend state: health, outlier ejection, in-flight counts, scraped load.

Everything else reads it through immutable snapshots. Time comes in as arguments (`now`), never from
a clock read here, so outlier ejection (`outliers`) is testable without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from backends.base import Adapter, Load

from ..routing.base import BackendView, Snapshot
from ..settings import Backend
from .outliers import OutlierRules, Record, Verdict, judge, readmit


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
    max_model_len: int | None = None  # from the backend's own /v1/models (`model_cards`), when it says
    card_scraped_at: float | None = None
    name: str = field(init=False)  # the config's, read once: the request path reads these on every request
    runtime: str = field(init=False)
    base_url: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.config.name
        self.runtime = self.config.runtime.value
        self.base_url = self.config.base_url

    @property
    def healthy(self) -> bool:
        return self.probe_ok and not self.ejected

    @property
    def consecutive_failures(self) -> int:
        return self.outliers.consecutive_failures

    @property
    def ejected_until(self) -> float | None:
        return self.outliers.ejected_until

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


class Pool:
    """Backend states by name, plus the outlier-ejection rule (`outliers`).

    A backend is ejected on consecutive failures or on its failure rate over a window of completed
    requests, for longer on each repeat; after that a passing health probe re-admits it.
    """

    def __init__(self, states: Iterable[BackendState], *, rules: OutlierRules | None = None) -> None:
        self._states = {s.name: s for s in states}
        self.rules = rules if rules is not None else OutlierRules()

    def __getitem__(self, name: str) -> BackendState:
        return self._states[name]

    def __iter__(self) -> Iterator[BackendState]:
        return iter(self._states.values())

    def __len__(self) -> int:
        return len(self._states)

    def snapshot(self, names: Iterable[str], throughput: Callable[[str], float | None] | None = None) -> Snapshot:
        """Frozen views of `names`; `throughput(name)` supplies measured output tokens/s (for cost)."""
        states = self._states
        if throughput is None:
            return Snapshot(tuple(states[n].view() for n in names))
        return Snapshot(tuple(states[n].view(throughput(n)) for n in names))

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self._states.values())

    def judge(self, name: str, ok: bool, now: float, error: str | None = None) -> Verdict:
        """Record a completed request's verdict on its backend; ejects it when the rules say so."""
        state = self._states[name]
        if not ok:
            state.last_error = error
        others = [s for s in self._states.values() if s is not state]
        verdict = judge(
            state.outliers, ok, now, self.rules, fleet=len(self._states),
            ejected_others=sum(s.ejected for s in others), routable_others=sum(s.healthy for s in others),
        )
        if verdict.eject_for_s is not None:
            state.ejected = True
            state.ejections += 1
        return verdict

    def record_probe(self, name: str, ok: bool, now: float, error: str | None = None) -> None:
        state = self._states[name]
        state.probe_ok = ok
        state.probed_at = now
        if not ok:
            state.last_error = error
        elif state.ejected and readmit(state.outliers, now):
            state.ejected = False

    def record_load(self, name: str, load: Load, now: float) -> None:
        state = self._states[name]
        state.load = load
        state.load_scraped_at = now
