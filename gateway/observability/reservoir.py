"""A bounded uniform sample of a stream of observations: the live percentiles' raw material.

Why reservoirs and not a sketch: tests (and operators) can check a percentile against the exact
samples fed in, as long as a reservoir holds fewer samples than its cap. Past the cap it keeps a
uniform random sample (Li's algorithm L with an injected, seeded RNG: it draws random numbers only for
the samples it keeps, so a full reservoir costs a counter increment per observation, which matters on
the per-token path) and remembers how many it saw, so merging reservoirs of unequal load weights each
retained sample by `seen / kept`.
"""

from __future__ import annotations

import math
import random
from array import array


class Reservoir:
    """At most `cap` samples out of `seen`, uniformly chosen; memory is O(cap)."""

    __slots__ = ("_next", "_w", "cap", "seen", "values")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.seen = 0
        self.values = array("d")
        self._w = 0.0
        self._next = 0  # the observation number (1-based) that will be kept next, once full

    def add(self, value: float, rng: random.Random) -> None:
        self.seen += 1
        if self.seen == self._next:
            self.values[int(rng.random() * self.cap)] = value  # not randrange: interpreted, ~1 µs a call
            self._advance(rng)
        elif len(self.values) < self.cap:
            self.values.append(value)
            if len(self.values) == self.cap:
                self._w = 1.0
                self._advance(rng)

    def _advance(self, rng: random.Random) -> None:
        """Algorithm L: shrink the acceptance threshold, then jump to the next kept observation."""
        self._w *= math.exp(math.log(rng.random() or 1e-300) / self.cap)
        gap = math.log(rng.random() or 1e-300) / math.log1p(-self._w) if self._w < 1.0 else 0.0
        self._next = self.seen + int(gap) + 1

    @property
    def weight(self) -> float:
        """How many observed samples each retained sample stands for."""
        return self.seen / len(self.values) if self.values else 0.0
