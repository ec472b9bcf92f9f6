"""Durations the faces report are simulated seconds, whatever the speed factor."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.base import Runtime
from backends.emulator.profiles import PROFILES
from tests.emulator.conftest import MakeEmulator

TINY = PROFILES["tiny"].runtimes[Runtime.VLLM]
PROMPT = "alpha beta gamma delta " * 200  # ~1400 tokens


async def ttft_sum(emu_url: str) -> tuple[float, float]:
    async with aiohttp.ClientSession() as s:
        async with s.post(emu_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}) as r:
            usage = (await r.json())["usage"]
        async with s.get(emu_url + "/metrics") as r:
            fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
    total = next(x.value for x in fams["vllm:time_to_first_token_seconds"].samples if x.name.endswith("_sum"))
    return total, float(usage["prompt_tokens"])


@pytest.mark.parametrize("speed", [5.0, 200.0])
async def test_ttft_metric_is_simulated_time(emulator: MakeEmulator, speed: float) -> None:
    emu = await emulator("vllm", speed=speed)
    ttft, prompt = await ttft_sum(emu.url)
    expected = TINY.t_fixed_s + prompt / TINY.prefill_tokens_per_s
    # One iteration of slack: the request may arrive in the middle of an idle-loop wake-up.
    assert expected * 0.99 <= ttft <= expected + 0.01


async def test_sglang_e2e_latency_is_simulated_time(emulator: MakeEmulator) -> None:
    emu = await emulator("sglang", speed=100.0)
    async with aiohttp.ClientSession() as s, s.post(emu.url + "/generate", json={
            "text": "hello", "sampling_params": {"max_new_tokens": 10}}) as r:
        meta = (await r.json())["meta_info"]
    p = PROFILES["tiny"].runtimes[Runtime.SGLANG]
    one_decode = p.t_fixed_s + p.w_base_s + p.w_moe_s * 0.25
    assert meta["e2e_latency"] >= 9 * one_decode
    assert meta["e2e_latency"] <= 12 * one_decode + 0.01
