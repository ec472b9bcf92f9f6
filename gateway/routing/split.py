"""A/B splits between runtimes: sticky arm assignment, arm failover and shadow sampling.

Assignment is weighted rendezvous hashing: for a sticky key (x-session-id, else the body's `user`,
else a digest of the API key), every arm scores `-ln(u(salt, key, arm)) / weight` and the lowest
wins. That picks arm i with probability weight_i / sum(weights) (the minimum of independent
exponentials), is a pure function of the key (a session never changes arm while the weights are
fixed, in any process), and changing one arm's weight changes only that arm's scores, so sessions
move only into or out of that arm. Without a sticky key the draw comes from `rng`.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from backends.values import value

from .hashing import stable_hash, unit_interval, weighted_score


class ArmLike(Protocol):
    """What we need of an arm (`gateway.settings.Arm` qualifies)."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...

    @property
    def backends(self) -> Sequence[str]: ...


def _key(sticky_key: str | None, salt: str, rng: random.Random) -> int:
    if sticky_key is None:
        return rng.getrandbits(64)
    return stable_hash(salt + "\x00" + sticky_key)


def rank_arms(sticky_key: str | None, arms: Mapping[str, float], *, salt: str, rng: random.Random) -> tuple[str, ...]:
    """Arms in this key's order of preference: weighted rendezvous over positive weights, then the
    zero-weight arms (drained arms are failover targets of last resort) in the given order."""
    key = _key(sticky_key, salt, rng)
    live = sorted((n for n, w in arms.items() if w > 0), key=lambda n: weighted_score(key, n, arms[n]))
    return (*live, *(n for n, w in arms.items() if w <= 0))


def assign_arm(sticky_key: str | None, arms: Mapping[str, float], *, salt: str, rng: random.Random) -> str:
    """The arm for `sticky_key` (deterministic and sticky), or a weighted random arm without a key."""
    if not any(w > 0 for w in arms.values()):
        raise ValueError("at least one arm needs a positive weight")
    return rank_arms(sticky_key, arms, salt=salt, rng=rng)[0]


@value
class ArmChoice:
    arm: str
    preferred: str  # the arm the key is assigned to
    failed_over: bool  # `arm` != `preferred` because the preferred arm had no healthy backend


def choose_arm(
    sticky_key: str | None,
    arms: Sequence[ArmLike],
    *,
    salt: str,
    healthy: Collection[str],
    rng: random.Random,
) -> ArmChoice | None:
    """The key's arm if any of its backends is healthy, else the key's next arm that has one (the
    proxy counts `failed_over`). None when no arm has a healthy backend."""
    order = rank_arms(sticky_key, {a.name: a.weight for a in arms}, salt=salt, rng=rng)
    by_name = {a.name: a for a in arms}
    for arm in order:
        if any(b in healthy for b in by_name[arm].backends):
            return ArmChoice(arm, order[0], arm != order[0])
    return None


def should_shadow(request_key: str | None, fraction: float, rng: random.Random, *, salt: str = "shadow") -> bool:
    """Whether to mirror this request to the shadow arm: a deterministic draw per key (so a replayed
    request is mirrored alike), or a random one without a key."""
    if fraction <= 0:
        return False
    if fraction >= 1:
        return True
    if request_key is None:
        return rng.random() < fraction
    return unit_interval(stable_hash(salt + "\x00" + request_key), "shadow") < fraction
