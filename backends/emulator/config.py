"""The emulator's public configuration and its live counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from backends.base import Runtime
from backends.emulator.faults import Faults

KvEncoding = Literal["map", "array"]


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """Publish KV-cache events the way the runtime does (see docs/emulator.md, "KV-cache events").

    vLLM and SGLang: a ZMQ PUB socket on `endpoint`, which *connects* unless the endpoint binds
    (`*`, `::`, `ipc://`, `inproc://`), as both runtimes decide; `replay_endpoint` (optional) is a
    ROUTER that resends buffered batches from a requested sequence number. trtllm-serve: events are
    queued and served by `POST /kv_cache_events` (the endpoint is unused). Test knobs:
    `drop_batches` are sequence numbers that are consumed but never sent (the subscriber sees a
    gap); after `silent_after` batches nothing more is sent (a silent publisher).
    """

    endpoint: str = "tcp://127.0.0.1:5557"
    topic: str = ""
    encoding: KvEncoding = "map"  # vLLM only: "map" (0.32, since PR #42892) or "array" (older, positional)
    replay_endpoint: str | None = None
    drop_batches: frozenset[int] = frozenset()
    silent_after: int | None = None
    buffer_steps: int = 10_000  # batches kept for replay (vLLM/SGLang `buffer_steps`)
    max_events: int = 10_000  # trtllm-serve `event_buffer_max_size`: older events are discarded


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    runtime: Runtime
    model: str = "tiny-moe"
    profile: str = "tiny"
    speed: float = 1.0  # simulated seconds per wall second
    faults: Faults = field(default_factory=Faults)
    max_model_len: int = 2048
    seed: int = 0
    prefix_reuse: bool | None = None  # None = the runtime's default (off for Triton, on otherwise)
    # Overrides of the profile: vLLM --block-size, SGLang --page-size, trtllm tokens_per_block ...
    block_size: int | None = None
    num_kv_blocks: int | None = None  # ... and the KV pool (vLLM --num-gpu-blocks-override)
    # An embedding model of this dimension (vLLM --runner pooling, SGLang --is-embedding).
    embedding_dim: int | None = None
    kv_events: KvEventsConfig | None = None
    # vLLM and SGLang: one server of this many data-parallel engines (`dp.py`: per-rank caches,
    # batching, KV events and metrics; the rank header/field; the runtime's own balancer)
    data_parallel_size: int = 1


@dataclass(slots=True)
class EmulatorStats:
    """Counters tests can read on a running emulator (not a Prometheus surface)."""

    requests_received: int = 0
    completed: int = 0
    aborted: int = 0
    failed_injected: int = 0
    rejected_queue_full: int = 0
    rejected_not_ready: int = 0
    died_mid_stream: int = 0
    tokens_generated: int = 0
