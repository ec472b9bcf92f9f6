"""Observability: what the gateway exports about itself and its comparisons, beyond the request families.

`process` (event-loop lag, open connections, process CPU and memory, build info), `info` (configured
prices), `arms` (per-arm outcome families for A/B panels), `install` (one call from the composition
root). May import the gateway's metric primitives (`metrics`, `promfast`, `native`), never the request
path's I/O.
"""

from .arms import ArmMetrics
from .info import PriceCollector
from .install import SELF_HEALTH, install
from .process import BuildInfo, ConnectionGauges, LoopLagMonitor, SelfHealth

__all__ = [
    "SELF_HEALTH", "ArmMetrics", "BuildInfo", "ConnectionGauges", "LoopLagMonitor", "PriceCollector", "SelfHealth",
    "install",
]
