"""Hysteresis for sources whose answers may name only some of the endpoints (DNS): an endpoint joins
at the first answer that names it, and leaves only once it has been missing for long enough.

Why. Some name servers answer with a subset of the records. Route 53 multivalue answers name up to
eight healthy records, chosen at random when there are more; a server that caps its answers (or a
UDP answer truncated without a TCP retry) names a rotating few. Followed literally (as Envoy's
STRICT_DNS clusters do), each answer drains the backends it left out and re-adds the ones it named
again, and every drain wipes a backend's routing memory and live comparison. HAProxy's resolvers
have the same knob (`hold obsolete`: how long a server missing from the answers is kept).

The rule (`Hold`): an endpoint in force leaves once it has been missing from `answers` answers in a
row *and* `seconds` have passed since the last answer that named it. Both: counting alone is quick
when answers come fast, seconds alone let one partial answer at the end of a spell of failures (no
answers at all, while the seconds run) drain everything it left out. `Hold(answers=1, seconds=0)`
follows every answer literally. Failures are not answers: they change nothing here.

Pure: no clock of its own (each answer comes with `now`), no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # endpoints.py imports config.py, which imports this module
    from .endpoints import Endpoint


@dataclass(frozen=True, slots=True)
class Hold:
    """How long an endpoint missing from the answers stays in force."""

    answers: int = 3  # answers in a row without it
    seconds: float = 60.0  # since the last answer that named it

    def __post_init__(self) -> None:
        if self.answers < 1 or self.seconds < 0:
            raise ValueError("a Hold needs answers >= 1 and seconds >= 0")


LITERAL = Hold(answers=1, seconds=0.0)  # every answer is the whole truth (a Kubernetes watch)


@dataclass(frozen=True, slots=True)
class Held:
    """The endpoints in force after an answer, and those of them the answer left out."""

    endpoints: frozenset[Endpoint]
    missing: frozenset[Endpoint] = frozenset()


@dataclass(slots=True)
class Presence:
    """The endpoints in force, answer after answer (see the module docstring)."""

    hold: Hold
    _seen_at: dict[Endpoint, float] = field(default_factory=dict)  # in force: when an answer last named it
    _missed: dict[Endpoint, int] = field(default_factory=dict)  # in force, missing: answers in a row without it

    @classmethod
    def of(cls, hold: Hold, known: frozenset[Endpoint], now: float) -> Presence:
        """Start from endpoints already in force (a restarted source's last set), as if named `now`."""
        return cls(hold, dict.fromkeys(known, now))

    @property
    def endpoints(self) -> frozenset[Endpoint]:
        return frozenset(self._seen_at)

    def answer(self, named: frozenset[Endpoint], now: float) -> Held:
        """An answer naming `named` arrived at `now`: the endpoints in force from now on."""
        for endpoint in named:
            self._seen_at[endpoint] = now
            self._missed.pop(endpoint, None)
        hold = self.hold
        for endpoint in [e for e in self._seen_at if e not in named]:
            missed = self._missed.get(endpoint, 0) + 1
            if missed >= hold.answers and now - self._seen_at[endpoint] >= hold.seconds:
                del self._seen_at[endpoint]
                self._missed.pop(endpoint, None)
            else:
                self._missed[endpoint] = missed
        return Held(frozenset(self._seen_at), frozenset(self._missed))
