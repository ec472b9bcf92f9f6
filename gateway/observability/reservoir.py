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
from collections.abc import Sequence


class Reservoir:
    """At most `cap` samples out of `seen`, uniformly chosen; memory is O(cap): `cap` doubles, held
    from the start in a typed buffer (a memoryview of doubles: storing one is a float conversion,
    where `array.append` parses its argument with PyArg_Parse, ~3x the instructions; a reservoir
    fills on every request, since a window bucket lasts a second)."""

    __slots__ = ("_buf", "_n", "_next", "_w", "cap", "seen")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.seen = 0
        self._buf = memoryview(bytearray(8 * cap)).cast("d")
        self._n = 0  # samples held: _buf[:_n]
        self._w = 0.0
        self._next = 0  # the observation number (1-based) that will be kept next, once full

    @property
    def values(self) -> memoryview[float]:
        """The samples held (a view: len, iteration, indexing, `tolist()`)."""
        return self._buf[:self._n]

    @values.setter
    def values(self, samples: Sequence[float]) -> None:
        """Hold exactly `samples` (a merged reservoir's), the cap raised to their number if needed."""
        self.cap, self._n = max(self.cap, len(samples)), len(samples)
        self._buf = memoryview(bytearray(8 * self.cap)).cast("d")
        for i, v in enumerate(samples):
            self._buf[i] = v

    def add(self, value: float, rng: random.Random) -> None:
        self.seen += 1
        if self.seen == self._next:
            self._buf[int(rng.random() * self.cap)] = value  # not randrange: interpreted, ~1 µs a call
            self._advance(rng)
        elif self._n < self.cap:
            self._buf[self._n] = value
            self._n += 1
            if self._n == self.cap:
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
        return self.seen / self._n if self._n else 0.0
