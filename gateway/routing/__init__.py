"""Pure routing policies: `choose(request, snapshot, rng) -> Decision`."""

from .base import BackendView, Decision, Policy, RouteRequest, Snapshot
from .simple import POLICIES, LeastLoad, RoundRobin

__all__ = ["POLICIES", "BackendView", "Decision", "LeastLoad", "Policy", "RoundRobin", "RouteRequest", "Snapshot"]
