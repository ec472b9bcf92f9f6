"""The live comparison of a real gateway process agrees with its own Prometheus counters."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway import json_codec
from gateway.__main__ import main

from .harness import Emulators, GatewayProcess, backend_entry, eventually, wait_for

StartGateway = Callable[..., GatewayProcess]
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Compare us."}]


def drive(gw: GatewayProcess, n: int) -> None:
    client = gw.client()
    for i in range(n):
        model = "ab" if i % 2 else "moe"
        if i % 3:
            for _ in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5 + i % 7, stream=True,
                                                    stream_options={"include_usage": True}):
                pass
        else:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5 + i % 7)
    assert gw.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES}).status_code == 404


def _sampler(fams: list[Any]) -> Callable[..., float]:
    def metric(name: str, **labels: str) -> float:
        return float(sum(s.value for f in fams for s in f.samples
                         if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())))

    return metric


def same_second_reads(gw: GatewayProcess) -> tuple[dict[str, Any], Callable[..., float], dict[str, Any]]:
    """compare, metrics, compare: repeated until both compare reads fall in the same clock second, so the
    scrape in between saw exactly the same buckets."""

    def reads() -> tuple[dict[str, Any], str, dict[str, Any]]:
        first = gw.get("/admin/compare", params={"window": 60}).json()
        metrics_text = gw.get("/metrics").text
        return first, metrics_text, gw.get("/admin/compare", params={"window": 3600}).json()

    first, metrics_text, second = wait_for(
        reads, lambda r: math.floor(r[0]["now_s"]) == math.floor(r[2]["now_s"]),
        what="two /admin/compare reads within one clock second")
    return first, _sampler(list(text_string_to_metric_families(metrics_text))), second


def start_ab(emulators: Emulators, gateway: StartGateway) -> GatewayProcess:
    vllm, sglang = emulators.start("vllm"), emulators.start("sglang")
    backends = [backend_entry("vllm-a", vllm, "vllm", usd_per_hour=96.0), backend_entry("sglang-a", sglang, "sglang")]
    routes = [
        {"model": "moe", "backends": ["vllm-a", "sglang-a"], "policy": "round_robin"},
        {"model": "ab", "split": {"arms": [{"name": "vllm", "weight": 1, "backends": ["vllm-a"]},
                                            {"name": "sglang", "weight": 1, "backends": ["sglang-a"]}]}},
    ]
    return gateway(backends, routes)


def test_admin_compare_agrees_with_metrics_and_the_cli(
    emulators: Emulators, gateway: StartGateway, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = start_ab(emulators, gateway)
    drive(gw, 24)
    # the comparison counts completed seconds only: wait until the second of the last request has passed
    eventually(lambda: gw.get("/admin/compare", params={"window": 60}).json()["total"]["requests"] == 25)
    live, metric, hour = same_second_reads(gw)

    for window in (live, hour):
        for b in window["backends"]:
            assert b["requests"] == metric("gateway_requests_total", backend=b["name"]), b["name"]
            assert b["output_tokens"] == metric("gateway_tokens_total", backend=b["name"], kind="completion")
            assert b["prompt_tokens"] == metric("gateway_tokens_total", backend=b["name"], kind="prompt")
            assert b["ttft_s"]["n"] == metric("gateway_time_to_first_token_seconds_count", backend=b["name"])
            assert b["itl_s"]["n"] == metric("gateway_inter_token_latency_seconds_count", backend=b["name"])
            tps = metric("gateway_backend_output_tokens_per_second", backend=b["name"])
            if window is live:
                assert tps == b["output_tokens_per_s"]
        assert window["total"]["requests"] == metric("gateway_requests_total") == 25
        assert window["total"]["errors"] == 1  # the unknown model

    vllm_row = next(b for b in live["backends"] if b["name"] == "vllm-a")
    cost = metric("gateway_backend_cost_per_million_tokens_usd", backend="vllm-a")
    expected = 96.0 / (3600 * vllm_row["output_tokens_per_s"]) * 1e6
    assert cost == vllm_row["cost"]["usd_per_million_output_tokens"] == expected
    sglang_row = next(b for b in live["backends"] if b["name"] == "sglang-a")
    assert sglang_row["cost"]["usd_per_million_output_tokens"] is None  # no usd_per_hour configured
    assert metric("gen_ai_client_token_usage_sum", gen_ai_token_type="output") == live["total"]["output_tokens"]

    ab = live["ab"][0]
    assert ab["route"] == "ab"
    assert ab["verdict"].startswith("not enough data yet")
    arm_requests = sum(a["requests"] for a in live["arms"])
    assert arm_requests == 12

    bad = gw.get("/admin/compare", params={"window": 7})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "window"

    monkeypatch.setenv("COLUMNS", "80")  # a plain terminal: nothing is cut, least of all the names
    assert main(["compare", "--url", gw.url, "--window", "3600"]) == 0
    printed = capsys.readouterr().out
    assert all(len(line) <= 80 for line in printed.splitlines())
    assert "…" not in printed
    rows = [line for line in printed.splitlines() if "vllm-a" in line]
    assert len(rows) == 2  # its performance row and its cost row, each with the whole name
    vllm_hour = next(b for b in hour["backends"] if b["name"] == "vllm-a")
    assert rows[0].rstrip(" │").split()[-1] == str(vllm_hour["requests"])
    assert "$96.00" in rows[1]  # the cost row leads with the configured price
    assert main(["compare", "--url", gw.url, "--window", "3600", "--json"]) == 0
    as_json = json_codec.loads(capsys.readouterr().out)
    assert {b["name"] for b in as_json["backends"]} == {"vllm-a", "sglang-a"}
