"""The emulator's public configuration and its live counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from backends.base import Runtime
from backends.emulator.faults import Faults

KvEncoding = Literal["map", "array"]
Role = Literal["prefill", "decode", "both"]


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
class DisaggConfig:
    """Prefill/decode disaggregation (docs/emulator.md, "Prefill/decode disaggregation").

    `role`: what the server may do with a P/D request: `prefill` produces KV for another server,
    `decode` consumes it, `both` either (vLLM `kv_role` kv_producer / kv_consumer / kv_both;
    SGLang `--disaggregation-mode prefill|decode`, where `both` is its `null` mode; trtllm-serve
    context / generation servers). The rest are the runtimes' own knobs, each used by one face:

    * vLLM: `connector` (`NixlConnector`, or `ExampleConnector` with `shared_storage_path`),
      `engine_id`, `load_failure_policy` (`recompute` | `fail`), the NIXL side channel
      (`side_channel_host`, `side_channel_port` + the DP rank; 0 picks a free port) and
      `kv_lease_s` (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`: how long a prefill keeps unread blocks).
    * SGLang: `bootstrap_port` (`--disaggregation-bootstrap-port`, a prefill's rendezvous HTTP
      server; 0 picks a free port), `bootstrap_timeout_s` (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`:
      a prefill waiting for its decode), `waiting_timeout_s` (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`:
      a decode waiting for its KV).
    * trtllm-serve: `kv_lease_s` (`cache_transceiver_config.kv_transfer_timeout_ms`) and the
      side channel its `encoded_opaque_state` points to.
    """

    role: Role = "both"
    connector: str = "NixlConnector"
    engine_id: str | None = None
    shared_storage_path: str | None = None
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    side_channel_host: str | None = None  # None: the emulator's own host
    side_channel_port: int = 0
    kv_lease_s: float = 480.0
    bootstrap_port: int | None = None
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0

    @property
    def produces(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def consumes(self) -> bool:
        return self.role in ("decode", "both")


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
    # Prefill/decode disaggregation; None: an aggregated server (vLLM without --kv-transfer-config,
    # SGLang --disaggregation-mode null; trtllm-serve still honours disaggregated_params)
    disagg: DisaggConfig | None = None


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
    # prefill/decode disaggregation (what each leg did; for tests)
    kv_produced: int = 0  # prefill-only requests whose KV was kept for a decode
    kv_pulled: int = 0  # decode requests that loaded a prefill's KV (tokens in kv_pulled_tokens)
    kv_pulled_tokens: int = 0
    kv_recomputed: int = 0  # decode requests that came with params but recomputed the prefill
    kv_expired: int = 0  # kept KV that no decode read in time (freed)
    pd_failed: int = 0  # P/D legs that failed (SGLang timeouts, trtllm transfer errors, vLLM policy "fail")
