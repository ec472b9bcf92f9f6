"""Pure routing policies: `choose(request, snapshot, rng) -> Decision`, plus the state they learn from.

Per request the proxy calls `describe` once, `decide` per attempt, and feeds `RoutingState` with what
it observes (see `state.py`). A/B arm assignment lives in `split.py`.
"""

from .affinity import PrefixAffinity
from .base import (
    NO_FEATURES,
    BackendView,
    Decision,
    Policy,
    PrefixLookup,
    RequestFeatures,
    RouteRequest,
    SlaTarget,
    Snapshot,
    stride_for,
)
from .cost import Cost
from .features import BadRoutingHeader, describe
from .latency import LatencyEstimator, LatencyModel
from .prefix_index import PrefixIndex, Sent
from .registry import POLICIES
from .simple import LeastLoad, RoundRobin
from .sla import Sla, decide
from .split import ArmChoice, assign_arm, choose_arm, rank_arms, should_shadow
from .state import RoutingState, Ticket

__all__ = [
    "NO_FEATURES",
    "POLICIES",
    "ArmChoice",
    "BackendView",
    "BadRoutingHeader",
    "Cost",
    "Decision",
    "LatencyEstimator",
    "LatencyModel",
    "LeastLoad",
    "Policy",
    "PrefixAffinity",
    "PrefixIndex",
    "PrefixLookup",
    "RequestFeatures",
    "RoundRobin",
    "RouteRequest",
    "RoutingState",
    "Sent",
    "Sla",
    "SlaTarget",
    "Snapshot",
    "Ticket",
    "assign_arm",
    "choose_arm",
    "decide",
    "describe",
    "rank_arms",
    "should_shadow",
    "stride_for",
]
