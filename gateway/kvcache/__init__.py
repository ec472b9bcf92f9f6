"""What the engines really hold in their prefix caches, from their own KV-cache events.

`events` decodes vLLM (tagged maps and positional arrays), SGLang and trtllm-serve events into one
model; `index.RankIndex` keeps one engine rank's resident blocks under the gateway's own chained
keys of their token ids (`routing.tokens`); `cache.BackendCache` tracks a backend's ranks, sequence
numbers, gaps, restarts and silence and says whether its index is live; `registry.KvCaches` holds
them all and is what the routing memory consults (`overlay`, `predict`) and feeds (`observe`);
`silence` says why a source hears nothing; `intake` runs the I/O (`zmq_source`: ZMQ subscribers and
replays, `trtllm_source`: trtllm-serve pollers); `relay` is the supervisor's share of it under
`--workers N` (what only one process may hear, heard once and republished to the workers);
`collector` exposes their state to Prometheus. All but `intake`, its sources and `relay` are pure
(time comes in as arguments or an injected clock).

May import: `routing` (its values), `settings`, `tasks`, `retrying`, `merge_rules`. Imported by `app` (wiring),
`admin` and `cluster` (the hub's relay).
"""

from .cache import BackendCache, State
from .intake import KvIntake
from .registry import KvCaches

__all__ = ["BackendCache", "KvCaches", "KvIntake", "State"]
