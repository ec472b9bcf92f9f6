"""How an emulator gets its P/D role (issue 23): the runtimes' own flags and environment (pure), the
CLI in its own process, the demo P/D fleet, and the decode's load while it waits for its KV."""

from __future__ import annotations

import asyncio
import re
import socket
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.base import Runtime
from backends.emulator import DisaggConfig
from backends.emulator.fleet import DEMO_PD_FLEET, start_fleet
from backends.emulator.pd_args import disagg_config
from tests.emulator.conftest import MakeEmulator
from tests.emulator.test_cli_fleet import cli
from tests.polling import until

LONG = "Summarise the following text. " + "The quick brown fox jumps over the lazy dog. " * 40
BODY: dict[str, Any] = {"model": "tiny-moe", "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}


def test_vllm_role_follows_kv_role_unless_role_narrows_it() -> None:
    nixl = '{"kv_connector":"NixlConnector","kv_role":"%s","engine_id":"e1","kv_load_failure_policy":"fail"}'
    assert disagg_config(Runtime.VLLM, role=None) is None  # no P/D flag: an aggregated server
    both = disagg_config(Runtime.VLLM, role=None, kv_transfer_config=nixl % "kv_both")
    assert both is not None
    assert (both.role, both.engine_id, both.load_failure_policy, both.side_channel_port) == ("both", "e1", "fail", 5600)
    producer = disagg_config(Runtime.VLLM, role=None, kv_transfer_config=nixl % "kv_producer")
    assert producer is not None
    assert producer.role == "prefill"
    narrowed = disagg_config(Runtime.VLLM, role="decode", kv_transfer_config=nixl % "kv_both")
    assert narrowed is not None
    assert narrowed.role == "decode"
    implied = disagg_config(Runtime.VLLM, role="prefill", env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "6100",
                                                               "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "30"})
    assert implied is not None
    assert (implied.connector, implied.side_channel_port, implied.kv_lease_s) == ("NixlConnector", 6100, 30.0)
    example = disagg_config(Runtime.VLLM, role=None, kv_transfer_config=(
        '{"kv_connector":"ExampleConnector","kv_role":"kv_both",'
        '"kv_connector_extra_config":{"shared_storage_path":"/tmp/kv"}}'))
    assert example is not None
    assert (example.connector, example.shared_storage_path) == ("ExampleConnector", "/tmp/kv")


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"role": "decode", "kv_transfer_config": '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'},
     "contradicts kv_role kv_producer"),
    ({"role": None, "kv_transfer_config": '{"kv_role":"kv_sideways"}'}, "kv_role must be"),
    ({"role": None, "kv_transfer_config": "not json"}, "not JSON"),
])
def test_contradictory_vllm_flags_fail_loudly(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        disagg_config(Runtime.VLLM, **kwargs)


def test_sglang_mode_and_timeouts() -> None:
    assert disagg_config(Runtime.SGLANG, role=None) is None
    prefill = disagg_config(Runtime.SGLANG, role=None, disaggregation_mode="prefill",
                            env={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "12"})
    assert prefill is not None
    assert (prefill.role, prefill.bootstrap_port, prefill.bootstrap_timeout_s) == ("prefill", 8998, 12.0)
    null = disagg_config(Runtime.SGLANG, role=None, disaggregation_mode="null")
    assert null is not None
    assert null.role == "both"
    with pytest.raises(ValueError, match="contradicts"):
        disagg_config(Runtime.SGLANG, role="decode", disaggregation_mode="prefill")
    with pytest.raises(ValueError, match="SGLang's"):
        disagg_config(Runtime.TRTLLM, role="prefill", bootstrap_port=1)
    with pytest.raises(ValueError, match="Triton"):
        disagg_config(Runtime.TRITON, role="prefill")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_cli_serves_the_side_channel_and_the_bootstrap_server(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
    port = free_port()
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(port))  # read by the engine, as vLLM reads it
    async with cli("vllm", "--kv-transfer-config", kv) as (line, url):
        assert f" role=prefill side_channel={port}" in line
        async with httpx.AsyncClient(timeout=30) as c:
            reply = await c.post(url + "/v1/chat/completions", json={
                **BODY, "model": "m", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert reply.json()["kv_transfer_params"]["remote_port"] == port
    async with cli("sglang", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0") as (line, _):
        m = re.search(r"bootstrap_port=(\d+)", line)
        assert m, line
        async with httpx.AsyncClient(timeout=30) as c:
            assert (await c.get(f"http://127.0.0.1:{m.group(1)}/health")).text == "OK"


async def test_the_demo_pd_fleet_serves_a_vllm_pair() -> None:
    fleet = await start_fleet(DEMO_PD_FLEET, speed=50.0, max_model_len=4096)
    try:
        by_name = {e.name: e for e in fleet}
        assert {e.config.disagg.role for e in fleet if e.config.disagg} == {"prefill", "decode"}
        assert by_name["sgl-p0"].bootstrap_port not in (None, 8998)  # free ports without a base port
        body = {**BODY, "model": "deepseek-v3"}
        async with httpx.AsyncClient(timeout=30) as c:
            leg1 = await c.post(by_name["vllm-p0"].url + "/v1/chat/completions", json={
                **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            params = leg1.json()["kv_transfer_params"]
            leg2 = await c.post(by_name["vllm-d0"].url + "/v1/chat/completions",
                                json={**body, "kv_transfer_params": params})
        assert leg2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        for emu in fleet:
            await emu.stop()


async def test_a_decode_waiting_for_its_kv_counts_as_waiting_deferred(emulator: MakeEmulator) -> None:
    p = await emulator("vllm", disagg=DisaggConfig(role="prefill"))
    d = await emulator("vllm", disagg=DisaggConfig(role="decode"), speed=0.02)  # a slow transfer to watch
    async with httpx.AsyncClient(timeout=60) as c:
        leg1 = await c.post(p.url + "/v1/chat/completions", json={
            **BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        leg2 = asyncio.create_task(c.post(d.url + "/v1/chat/completions",
                                          json={**BODY, "kv_transfer_params": leg1.json()["kv_transfer_params"]}))
        await until(lambda: d.snapshot().deferred == 1)
        text = (await c.get(d.url + "/metrics")).text
        assert (await leg2).status_code == 200
    gauges = {(s.name, s.labels.get("reason")): s.value for f in text_string_to_metric_families(text)
              for s in f.samples if s.name.startswith("vllm:num_requests_waiting")}
    assert gauges[("vllm:num_requests_waiting", None)] == 1
    assert gauges[("vllm:num_requests_waiting_by_reason", "deferred")] == 1
    assert gauges[("vllm:num_requests_waiting_by_reason", "capacity")] == 0
    assert d.snapshot().deferred == 0
