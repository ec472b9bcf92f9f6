"""The embedded demo: a small mixed fleet of emulated runtimes and a gateway config in front of it.

`gateway serve` with no `--config` starts this, so a new user sees a working multi-runtime gateway in
seconds. The same fleet, run as separate processes, is `config/demo.yaml`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from backends.base import Runtime
from backends.emulator import RunningEmulator
from backends.emulator.fleet import DEMO_EMBEDDING_FLEET, DEMO_FLEET, DEMO_PD_FLEET, DEMO_WIDE_FLEET, start_fleet

from .settings import Settings, parse_settings

DEMO_MODEL = "deepseek-v3"
DEMO_EMBEDDING_MODEL = "bge-m3"
DEMO_PD_MODEL = "deepseek-v3-pd"  # the same model, served by a prefill/decode pair
DEMO_SPEED = 1.0
# Prefill/decode pairs (`backends/emulator/fleet.py` DEMO_PD_FLEET): vLLM (NixlConnector roles),
# SGLang (bootstrap rendezvous) and trtllm-serve (context/generation), one route each (a pair speaks
# one runtime's protocol); `when: auto` splits the prompts with at least DEMO_PD_MIN_UNCACHED
# uncached tokens on the decode; SGLang's pair splits them all (`always`: a decode-mode SGLang server
# serves no request whole). The embedded demo lets the SGLang prefill pick a free bootstrap port.
DEMO_PD_ROUTES = {Runtime.VLLM: DEMO_PD_MODEL, Runtime.SGLANG: f"{DEMO_PD_MODEL}-sglang",
                  Runtime.TRTLLM: f"{DEMO_PD_MODEL}-trtllm"}
DEMO_PD_MIN_UNCACHED = 512


@dataclass
class Demo:
    settings: Settings
    emulators: list[RunningEmulator]

    async def stop(self) -> None:
        for emu in self.emulators:
            await emu.stop()

    def banner(self, url: str) -> str:
        names = ", ".join(f"{b.name} ({b.runtime.value})" for b in self.settings.backends)
        return f"""
Demo fleet: {names}.
Point any OpenAI SDK at it:

    from openai import OpenAI
    client = OpenAI(base_url="{url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="{DEMO_MODEL}",
        messages=[{{"role": "user", "content": "Which runtime served me?"}}],
    )
    print(reply.choices[0].message.content)
    # prefill/decode pairs (vLLM: vllm-p0 -> vllm-d0; also {DEMO_PD_MODEL}-sglang and -trtllm):
    # long prompts are split, short ones served whole
    client.chat.completions.create(model="{DEMO_PD_MODEL}", messages=[{{"role": "user", "content": "hi " * 800}}])
    print(client.responses.create(model="{DEMO_MODEL}", input="Hello").output_text)
    print(client.embeddings.create(model="{DEMO_EMBEDDING_MODEL}", input="Hello").data[0].embedding[:4])

Live runtime comparison: {url}/dashboard   (JSON: {url}/admin/compare, terminal: gateway compare --url {url})
Backends and their load:  {url}/admin/backends   Prometheus: {url}/metrics
"""


async def start_demo(*, host: str = "127.0.0.1", speed: float = DEMO_SPEED, base_port: int | None = None) -> Demo:
    """`base_port`: the fleet on fixed ports (`DEMO_BASE_PORT`: config/demo.yaml's, which
    deploy/envoy/envoy.yaml's pool names), else on free ones."""
    pd_fleet = [dataclasses.replace(s, disagg=dataclasses.replace(s.disagg, bootstrap_port=0))
                if s.disagg is not None and s.disagg.bootstrap_port else s for s in DEMO_PD_FLEET]
    specs = [*DEMO_FLEET, *DEMO_WIDE_FLEET, *DEMO_EMBEDDING_FLEET, *pd_fleet]
    emulators = await start_fleet(specs, speed=speed, host=host, base_port=base_port)
    backends = []
    for spec, emu in zip(specs, emulators, strict=True):
        entry: dict[str, object] = {
            "name": spec.name,
            "runtime": spec.runtime.value,
            "url": emu.url,
            "model": spec.model,
            "usd_per_hour": emu.usd_per_hour,
        }
        if emu.metrics_url != emu.url:
            entry["metrics_url"] = emu.metrics_url
        if spec.data_parallel_size > 1:  # the wide-EP server: each rank a routing unit
            entry["data_parallel_size"] = spec.data_parallel_size
        if spec.disagg is not None:  # a P/D pair: each server's role (and an SGLang prefill's bootstrap port)
            entry["role"] = spec.disagg.role
            if emu.bootstrap_port is not None and spec.disagg.role != "decode":
                entry["bootstrap_port"] = emu.bootstrap_port
        backends.append(entry)
    settings = parse_settings(
        {
            "listen": {"host": host, "port": 8080},
            "backends": backends,
            "routes": [
                {"model": DEMO_MODEL, "backends": [s.name for s in (*DEMO_FLEET, *DEMO_WIDE_FLEET)],
                 "policy": "least_load"},
                {"model": DEMO_EMBEDDING_MODEL, "kind": "embeddings",
                 "backends": [s.name for s in DEMO_EMBEDDING_FLEET]},
                *({"model": model, "backends": [s.name for s in DEMO_PD_FLEET if s.runtime is runtime],
                   "policy": "least_load",
                   "disaggregation": {"when": "always"} if runtime is Runtime.SGLANG else
                   {"when": "auto", "min_uncached_tokens": DEMO_PD_MIN_UNCACHED}}
                  for runtime, model in DEMO_PD_ROUTES.items()),
            ],
            "health": {"interval_s": 1.0},
        },
        source="<embedded demo>",
    )
    return Demo(settings, emulators)
