"""The demo fleet: one emulator per runtime, all serving a DeepSeek-V3-like profile, so the gateway's
embedded demo (and `config/demo.yaml`, started by hand) can compare runtimes side by side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from backends.base import Runtime
from backends.emulator.config import DisaggConfig, EmulatorConfig
from backends.emulator.faults import Faults
from backends.emulator.server import RunningEmulator, start_emulator


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """One emulator of a fleet. Ports are `base_port + port_offset` (and `metrics_port_offset` for
    Triton's separate metrics port); with no base port every emulator picks a free port."""

    name: str
    runtime: Runtime
    model: str
    profile: str
    port_offset: int
    metrics_port_offset: int | None = None
    faults: Faults = field(default_factory=Faults)
    embedding_dim: int | None = None  # an embedding model (vLLM `--runner pooling`)
    data_parallel_size: int = 1  # one server of this many DP engines (a wide-EP server)
    # a P/D role (vLLM NixlConnector / ExampleConnector, SGLang prefill with `bootstrap_port`, trtllm
    # context/generation server); None: aggregated. Its ports (NIXL side channel, SGLang bootstrap)
    # are picked free unless set; the running emulator reports them (`side_channel_ports`, `bootstrap_port`).
    disagg: DisaggConfig | None = None


DEMO_FLEET: list[FleetSpec] = [
    FleetSpec("vllm-a", Runtime.VLLM, "deepseek-v3", "deepseek-v3-8xh200", 1),
    FleetSpec("sglang-a", Runtime.SGLANG, "deepseek-v3", "deepseek-v3-8xh200", 2),
    FleetSpec("trtllm-a", Runtime.TRTLLM, "deepseek-v3", "deepseek-v3-8xh200", 3),
    FleetSpec("triton-a", Runtime.TRITON, "ensemble", "deepseek-v3-8xh200", 4, metrics_port_offset=5),
]
# The demo's embedding model: a vLLM pooling model on the synthetic `tiny` profile (1 GPU at an assumed $1/h).
DEMO_EMBEDDING_FLEET: list[FleetSpec] = [
    FleetSpec("embed-a", Runtime.VLLM, "bge-m3", "tiny", 6, embedding_dim=1024),
]
# A wide-EP server: one vLLM of 4 data-parallel ranks (attention DP, expert parallel), on port 8007.
DEMO_WIDE_FLEET: list[FleetSpec] = [
    FleetSpec("vllm-wide", Runtime.VLLM, "deepseek-v3", "deepseek-v3-8xh200", 7, data_parallel_size=4),
]
DEMO_BASE_PORT = 8000  # DEMO_FLEET on fixed ports 8001..8005, DEMO_EMBEDDING_FLEET on 8006, as in config/demo.yaml


async def start_fleet(
    specs: Sequence[FleetSpec], *, speed: float, host: str = "127.0.0.1", base_port: int | None = None,
    max_model_len: int = 32768, seed: int = 0,
) -> list[RunningEmulator]:
    """Start every emulator in `specs`; on failure, stop the ones already started and re-raise."""
    started: list[RunningEmulator] = []
    try:
        for i, spec in enumerate(specs):
            cfg = EmulatorConfig(runtime=spec.runtime, model=spec.model, profile=spec.profile, speed=speed,
                                 faults=spec.faults, max_model_len=max_model_len, seed=seed + i,
                                 embedding_dim=spec.embedding_dim, data_parallel_size=spec.data_parallel_size,
                                 disagg=spec.disagg)
            port = 0 if base_port is None else base_port + spec.port_offset
            mport = 0 if base_port is None or spec.metrics_port_offset is None else base_port + spec.metrics_port_offset
            emu = await start_emulator(cfg, host=host, port=port, metrics_port=mport)
            emu.name = spec.name
            started.append(emu)
    except BaseException:
        for emu in started:
            await emu.stop()
        raise
    return started
