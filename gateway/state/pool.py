"""The only mutable backend state: health, circuit breaker, in-flight counts, scraped load.

Everything else reads it through immutable snapshots. Time comes in as arguments (`now`), never from
a clock read here, so the breaker's state machine is testable without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from backends.base import Adapter, Load

from ..routing.base import BackendView, Snapshot
from ..settings import Backend


@dataclass(slots=True)
class BackendState:
    config: Backend
    adapter: Adapter
    probe_ok: bool = True  # optimistic until the first probe says otherwise
    ejected: bool = False
    ejected_until: float = 0.0
    consecutive_failures: int = 0
    ejections: int = 0
    in_flight: int = 0
    load: Load = field(default_factory=Load)
    load_scraped_at: float | None = None
    probed_at: float | None = None
    last_error: str | None = None
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
    """Backend states by name, plus the circuit breaker rule.

    A backend is ejected after `failure_threshold` consecutive failures (connect errors, timeouts,
    5xx) and stays out for at least `cooldown_s`; after that a passing health probe re-admits it.
    """

    def __init__(self, states: Iterable[BackendState], *, failure_threshold: int, cooldown_s: float) -> None:
        self._states = {s.name: s for s in states}
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s

    def __getitem__(self, name: str) -> BackendState:
        return self._states[name]

    def __iter__(self) -> Iterator[BackendState]:
        return iter(self._states.values())

    def snapshot(self, names: Iterable[str], throughput: Callable[[str], float | None] | None = None) -> Snapshot:
        """Frozen views of `names`; `throughput(name)` supplies measured output tokens/s (for cost)."""
        states = self._states
        if throughput is None:
            return Snapshot(tuple(states[n].view() for n in names))
        return Snapshot(tuple(states[n].view(throughput(n)) for n in names))

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self._states.values())

    def record_success(self, name: str) -> None:
        self._states[name].consecutive_failures = 0

    def record_failure(self, name: str, now: float, error: str) -> bool:
        """Count a failure; returns True when this failure ejected the backend."""
        state = self._states[name]
        state.consecutive_failures += 1
        state.last_error = error
        if not state.ejected and state.consecutive_failures >= self.failure_threshold:
            state.ejected = True
            state.ejected_until = now + self.cooldown_s
            state.ejections += 1
            return True
        return False

    def record_probe(self, name: str, ok: bool, now: float, error: str | None = None) -> None:
        state = self._states[name]
        state.probe_ok = ok
        state.probed_at = now
        if not ok:
            state.last_error = error
        elif state.ejected and now >= state.ejected_until:
            state.ejected = False
            state.consecutive_failures = 0

    def record_load(self, name: str, load: Load, now: float) -> None:
        state = self._states[name]
        state.load = load
        state.load_scraped_at = now
