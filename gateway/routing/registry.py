"""Policies by the names the config uses (`Route.policy`). Policies are stateless; one instance
serves every route."""

from __future__ import annotations

from typing import Final

from .affinity import PrefixAffinity
from .base import Policy
from .cost import Cost
from .simple import LeastLoad, RoundRobin
from .sla import Sla

POLICIES: dict[str, Policy] = {p.name: p for p in (RoundRobin(), LeastLoad(), PrefixAffinity(), Sla(), Cost())}



def policy_for(name: str, *, load_factor: float | None = None) -> Policy:
    """The policy a route names, with its balance knob when the route sets one (`routes[].load_factor`:
    prefix_affinity's bounded-load factor; the shared default instance otherwise)."""
    if load_factor is None:
        return POLICIES[name]
    if name != "prefix_affinity":
        raise ValueError(f"load_factor applies to prefix_affinity only, not {name}")
    return PrefixAffinity(load_factor=load_factor)


# Policies that read the prefix index: where no route uses one, the gateway does not hash prompts or
# keep the index at all (it would cost every request for nothing).
PREFIX_POLICIES: Final = frozenset({"prefix_affinity", "sla", "cost"})
