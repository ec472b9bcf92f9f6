"""The A/B verdict, computed live from real traffic, names the arm the emulator profiles make faster.

Ground truth (docs/emulator.md): on the DeepSeek-V3 8xH200 profile SGLang prefills ~2.7x faster than
vLLM (40k vs 15k tok/s) and decodes ~2x faster per stream (19 ms vs 40 ms per token).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .harness import Emulators, GatewayProcess, backend_entry, wait_for

StartGateway = Callable[..., GatewayProcess]
DOC = "The harbour master's log, page after page of tides and ships. " * 80  # ~1.3k tokens


def test_ab_verdict_matches_the_profiles_ground_truth(emulators: Emulators, gateway: StartGateway) -> None:
    profile = "deepseek-v3-8xh200"
    # slow enough that the prefill gap (~29 ms against ~11 ms of wall time) stands out of a busy
    # machine's scheduling noise
    v = emulators.start("vllm", model="deepseek-v3", profile=profile, speed=3.0)
    s = emulators.start("sglang", model="deepseek-v3", profile=profile, speed=3.0)
    gw = gateway(
        [backend_entry("v", v, "vllm", model="deepseek-v3", usd_per_hour=96.0),
         backend_entry("s", s, "sglang", model="deepseek-v3", usd_per_hour=96.0)],
        routes=[{"model": "moe", "policy": "least_load", "split": {"arms": [
            {"name": "vllm", "weight": 50, "backends": ["v"]},
            {"name": "sglang", "weight": 50, "backends": ["s"]}]}}],
    )
    client = gw.client()

    def one(i: int) -> str:
        stream = client.chat.completions.create(
            model="moe", messages=[{"role": "user", "content": f"{i}: {DOC}"}], max_tokens=6, stream=True,
            extra_headers={"x-session-id": f"session-{i}"},
        )
        for _ in stream:
            pass
        return "ok"

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(320))).count("ok") == 320

    def analysis() -> dict[str, Any]:
        [ab] = gw.get("/admin/compare", params={"window": 300}).json()["ab"]
        return ab  # type: ignore[no-any-return]

    # windows count completed seconds only and the A/B analysis is refreshed every few seconds:
    # poll (with a deadline) until it covers the traffic above
    ab = wait_for(analysis, lambda ab: not ab["verdict"].startswith("not enough data"), what="an A/B verdict")
    verdict = ab["verdict"]
    assert verdict.startswith("sglang:"), verdict
    assert "TTFT p50" in verdict
    assert "lower" in verdict
    assert not ab["srm"]["flagged"]
    ttft = next(c for c in ab["comparisons"] if c["treatment"] == "sglang")["metrics"]["ttft_p50_s"]
    assert ttft["ci95"][1] < 0  # sglang's TTFT p50 is lower, and the interval says so
