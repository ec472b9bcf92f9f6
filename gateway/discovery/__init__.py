"""Backend discovery: pools of backends found in DNS or Kubernetes, followed while the gateway runs.

Imports nothing of the gateway but its JSON codec, its retry rule (`gateway.retrying`), its metrics'
merge rules (`gateway.merge_rules`) and
`backends.base.Runtime`; the composition root wires it to the pool through `gateway.state.membership`. The pieces:

- config.py: the `discovery:` config entries (mounted as `Settings.discovery`).
- source.py: the `Source` contract, `changes()` (the one loop that counts and yields changes of the
  set in force) and `run()`; start here.
- hysteresis.py: `Hold`, `Presence`: an endpoint an answer leaves out stays until missing long
  enough (DNS answers may name a subset of the records).
- endpoints.py: `Endpoint`, and `backends_of(entry, endpoints)`, the backends an entry makes.
- dns.py, kubernetes.py (+ kubernetes_objects.py, kubernetes_auth.py): the two sources.
- metrics.py: `gateway_discovery_*` on an explicit registry.
- factory.py: `make_source(entry)`.
"""

from ..retrying import Backoff
from .config import DiscoveryEntry, DnsDiscovery, KubernetesDiscovery
from .endpoints import DiscoveredBackend, Endpoint, backends_of
from .factory import make_source
from .hysteresis import LITERAL, Hold
from .metrics import DiscoveryMetrics
from .source import Change, Failed, Observation, Resolved, Source, changes, run

__all__ = [
    "LITERAL",
    "Backoff",
    "Change",
    "DiscoveredBackend",
    "DiscoveryEntry",
    "DiscoveryMetrics",
    "DnsDiscovery",
    "Endpoint",
    "Failed",
    "Hold",
    "KubernetesDiscovery",
    "Observation",
    "Resolved",
    "Source",
    "backends_of",
    "changes",
    "make_source",
    "run",
]
