"""Observability: the per-request `Outcome` (`outcome`) and the Prometheus families it feeds
(`metrics`, on the lock-free primitives of `lockfree`), and what the gateway exports about itself:
`process` (event-loop lag, open connections, process CPU and memory, build info), `info` (configured
prices), `arms` (per-arm outcome families for A/B panels), `access_log` (a line per request, when
configured), `install` (one call from the composition root). Imports nothing of the request path's I/O.
"""

from . import access_log
from .arms import ArmMetrics
from .info import PriceCollector
from .install import install
from .process import BuildInfo, ConnectionGauges, LoopLagMonitor, SelfHealth

__all__ = [
    "ArmMetrics",
    "BuildInfo",
    "ConnectionGauges",
    "LoopLagMonitor",
    "PriceCollector",
    "SelfHealth",
    "access_log",
    "install",
]
