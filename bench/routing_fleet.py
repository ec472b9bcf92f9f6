"""An emulated fleet in its own process, with derived profiles (KV capacity, slower iterations).

    python -m bench.routing_fleet '<json list of backend specs>'

Prints one line `fleet ready <json {name: url}>` once every emulator listens, then serves until
SIGTERM/SIGINT. Derived profiles are built from the named profile with `dataclasses.replace` and
registered in this process's `PROFILES` under a new name before the emulators start; the emulator
code is used unchanged. Running the fleet apart from the measuring client keeps the client's event
loop free of engine work (the machine has 2 cores: client, gateway and fleet each get a process).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from dataclasses import dataclass, replace
from typing import Any

import orjson

from backends.base import Runtime
from backends.emulator import PROFILES, EmulatorConfig, KvEventsConfig, start_emulator
from backends.emulator.profiles import EngineParams, Profile


@dataclass(frozen=True, slots=True)
class BackendSpec:
    name: str
    profile: str = "deepseek-v3-8xh200"
    runtime: str = "vllm"
    speed: float = 10.0
    kv_tokens: int | None = None  # None: the profile's KV capacity
    slow: float = 1.0  # multiplies every iteration cost term (and divides the prefill rate)
    kv_events: str | None = None  # publish KV-cache events to this endpoint (the engine connects to it)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "profile": self.profile, "runtime": self.runtime, "speed": self.speed,
                "kv_tokens": self.kv_tokens, "slow": self.slow, "kv_events": self.kv_events}


def derive(params: EngineParams, *, kv_tokens: int | None, slow: float) -> EngineParams:
    """`params` with another KV capacity and/or every time cost multiplied by `slow`."""
    out = params
    if kv_tokens is not None:
        out = replace(out, kv_blocks=max(1, kv_tokens // max(1, out.block_size)))
    if slow != 1.0:
        out = replace(out, t_fixed_s=out.t_fixed_s * slow, w_base_s=out.w_base_s * slow, w_moe_s=out.w_moe_s * slow,
                      kv_read_s_per_token=out.kv_read_s_per_token * slow,
                      decode_s_per_token=out.decode_s_per_token * slow,
                      prefill_tokens_per_s=out.prefill_tokens_per_s / slow)
    return out


def register(spec: BackendSpec) -> str:
    """The profile name to start `spec` with (a derived profile is registered in PROFILES)."""
    if spec.kv_tokens is None and spec.slow == 1.0:
        return spec.profile
    base = PROFILES[spec.profile]
    name = f"{spec.profile}@kv={spec.kv_tokens}@slow={spec.slow:g}"
    runtimes = {rt: derive(p, kv_tokens=spec.kv_tokens, slow=spec.slow) for rt, p in base.runtimes.items()}
    PROFILES[name] = Profile(name=name, hardware=base.hardware, gpus=base.gpus,
                             usd_per_gpu_hour=base.usd_per_gpu_hour,
                             default_output_tokens=base.default_output_tokens, runtimes=runtimes)
    return name


async def _main(specs: list[BackendSpec]) -> None:
    emus = []
    try:
        for i, s in enumerate(specs):
            kv = KvEventsConfig(endpoint=s.kv_events) if s.kv_events else None
            cfg = EmulatorConfig(runtime=Runtime(s.runtime), model="moe-model", profile=register(s), speed=s.speed,
                                 max_model_len=131072, seed=i, kv_events=kv)
            emu = await start_emulator(cfg, host="127.0.0.1", port=0)
            emu.name = s.name
            emus.append(emu)
        print("fleet ready " + orjson.dumps({e.name: e.url for e in emus}).decode(), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        for e in emus:
            await e.stop()


def main() -> None:
    specs = [BackendSpec(**d) for d in orjson.loads(sys.argv[1])]
    try:
        import uvloop

        uvloop.run(_main(specs))
    except ImportError:
        asyncio.run(_main(specs))


if __name__ == "__main__":
    main()
