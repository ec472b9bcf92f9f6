"""Emulated serving runtimes: one simulation core, four protocol faces (vLLM, SGLang, trtllm-serve,
Triton + TensorRT-LLM), fault knobs and calibrated performance profiles.

Public API (kept stable for the gateway, its tests and the demo):
`EmulatorConfig`, `KvEventsConfig`, `DisaggConfig`, `Faults`, `RunningEmulator`, `start_emulator`, `PROFILES`.
"""

from backends.emulator.config import DisaggConfig, EmulatorConfig, EmulatorStats, KvEventsConfig
from backends.emulator.faults import Faults
from backends.emulator.profiles import PROFILES, Profile
from backends.emulator.server import RunningEmulator, start_emulator

__all__ = [
    "PROFILES", "DisaggConfig", "EmulatorConfig", "EmulatorStats", "Faults", "KvEventsConfig", "Profile",
    "RunningEmulator", "start_emulator",
]
