"""The emulator's public configuration and its live counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.base import Runtime
from backends.emulator.faults import Faults


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
