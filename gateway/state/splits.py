"""A/B splits at run time: live arm weights per route, arm choice with failover.

The assignment itself is pure (`routing.split`); this module holds the one piece of mutable state,
the current weights, which an admin endpoint may change without a restart. A weight change moves
only the sessions it must (weighted rendezvous hashing), so changing weights is safe mid-experiment.
The live splits belong to the app, not to a config generation (`Splits`): a reload that leaves a
route's split as it was keeps its live weights.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ..routing.split import ArmChoice, choose_arm
from ..settings import Route


@dataclass(frozen=True, slots=True)
class LiveArm:
    name: str
    weight: float
    backends: tuple[str, ...]


class LiveSplit:
    def __init__(self, route: Route) -> None:
        assert route.split is not None
        self.configured = route.split
        self.sticky = route.split.sticky
        self.salt = route.split.salt or route.model
        self.shadow = route.split.shadow
        self.arms: tuple[LiveArm, ...] = tuple(
            LiveArm(a.name, a.weight, tuple(a.backends)) for a in route.split.arms
        )

    @property
    def weights(self) -> dict[str, float]:
        return {a.name: a.weight for a in self.arms}

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Replace some or all weights atomically; unknown arms or a zero total raise ValueError."""
        unknown = sorted(set(weights) - {a.name for a in self.arms})
        if unknown:
            raise ValueError(f"unknown arm(s) {unknown}")
        if any(w < 0 for w in weights.values()):
            raise ValueError("weights must be >= 0")
        arms = tuple(LiveArm(a.name, float(weights.get(a.name, a.weight)), a.backends) for a in self.arms)
        if sum(a.weight for a in arms) <= 0:
            raise ValueError("at least one arm needs a positive weight")
        self.arms = arms

    def choose(self, sticky_key: str | None, healthy: Collection[str], rng: random.Random) -> ArmChoice | None:
        return choose_arm(sticky_key, self.arms, salt=self.salt, healthy=healthy, rng=rng)

    def arm(self, name: str) -> LiveArm:
        return next(a for a in self.arms if a.name == name)


class Splits:
    """The live split of every split route, kept across config reloads while a route's split stays
    as configured (a changed split starts from the new file's weights). In two phases, as a reload:
    a generation being prepared takes `for_route` (the kept split, or a new one kept by no one yet);
    once it commits, `keep` makes its splits the live ones (a refused reload changes nothing)."""

    def __init__(self) -> None:
        self._live: dict[str, LiveSplit] = {}

    def for_route(self, route: Route) -> LiveSplit:
        assert route.split is not None
        live = self._live.get(route.model)
        if live is None or live.configured != route.split:
            live = LiveSplit(route)
        return live

    def keep(self, live: Mapping[str, LiveSplit]) -> None:
        """The committed generation's splits, by route model: the only ones kept from now on."""
        self._live = dict(live)
