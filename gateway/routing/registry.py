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

# Policies that read the prefix index: where no route uses one, the gateway does not hash prompts or
# keep the index at all (it would cost every request for nothing).
PREFIX_POLICIES: Final = frozenset({"prefix_affinity", "sla", "cost"})
