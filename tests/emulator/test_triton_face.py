"""Triton + TensorRT-LLM backend: the generate extension, v2 health, metrics on their own port."""

from __future__ import annotations

import re

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from tests.emulator.conftest import MakeEmulator


async def test_generate_keys_are_alphabetical_with_token_counts(emulator: MakeEmulator) -> None:
    emu = await emulator("triton", model="ensemble")
    async with aiohttp.ClientSession() as s, s.post(emu.url + "/v2/models/ensemble/generate", json={
            "text_input": "What is ML?", "max_tokens": 4, "bad_words": "", "stop_words": "",
            "exclude_input_in_output": True, "return_num_input_tokens": True, "return_num_output_tokens": True,
            "temperature": 0.5}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/json")
        body = await r.json()
    assert list(body) == sorted(body)
    assert body["model_name"] == "ensemble"
    assert body["model_version"] == "1"
    assert body["num_output_tokens"] == 4
    assert body["num_input_tokens"] > 0
    assert not body["text_output"].startswith("What is ML?")


async def test_generate_stream_sends_deltas_without_done(emulator: MakeEmulator) -> None:
    emu = await emulator("triton", model="ensemble")
    async with aiohttp.ClientSession() as s, s.post(emu.url + "/v2/models/ensemble/generate_stream", json={
            "text_input": "Count", "max_tokens": 3, "stream": True, "exclude_input_in_output": True}) as r:
        assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        raw = await r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert len(events) == 3
    assert b"[DONE]" not in raw
    assert all(list(orjson.loads(e[6:])) == sorted(orjson.loads(e[6:])) for e in events)


async def test_errors_and_health(emulator: MakeEmulator) -> None:
    emu = await emulator("triton", model="ensemble")
    async with aiohttp.ClientSession() as s:
        async with s.post(emu.url + "/v2/models/foo/generate", json={"text_input": "x", "max_tokens": 1}) as r:
            assert r.status == 400
            assert await r.json() == {"error": "Request for unknown model: 'foo' is not found"}
        async with s.post(emu.url + "/v2/models/ensemble/generate", json={"text_input": "x", "max_tokens": "x"}) as r:
            assert r.status == 400
        async with s.post(emu.url + "/v2/models/ensemble/generate", json={"text_input": "x"}) as r:
            assert r.status == 400
            assert "max_tokens" in (await r.json())["error"]
        for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/ensemble/ready", "/v2",
                     "/v2/models/ensemble"):
            async with s.get(emu.url + path) as r:
                assert r.status == 200, path
    slow = await emulator("triton", model="ensemble", not_ready_for_s=60)
    async with aiohttp.ClientSession() as s:
        async with s.get(slow.url + "/v2/health/ready") as r:
            assert r.status == 400  # Triton says 400, not 503
        async with s.get(slow.url + "/v2/health/live") as r:
            assert r.status == 200


async def test_metrics_on_their_own_port_in_prometheus_cpp_style(emulator: MakeEmulator) -> None:
    emu = await emulator("triton", model="ensemble")
    assert emu.metrics_url != emu.url
    async with aiohttp.ClientSession() as s:
        async with s.post(emu.url + "/v2/models/ensemble/generate", json={"text_input": "x", "max_tokens": 2}) as r:
            assert r.status == 200
        async with s.get(emu.url + "/metrics") as r:
            assert r.status == 404
        async with s.get(emu.metrics_url + "/metrics") as r:
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            text = await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    waiting = [x for x in fams["nv_trt_llm_request_metrics"].samples if x.labels["request_type"] == "waiting"]
    assert waiting
    assert waiting[0].labels["model"] == "tensorrt_llm"
    assert {x.labels["kv_cache_block_type"] for x in fams["nv_trt_llm_kv_cache_block_metrics"].samples} >= {
        "max", "free", "used", "tokens_per", "fraction"}
    success = [x for x in fams["nv_inference_request_success"].samples if x.labels["model"] == "ensemble"]
    assert success[0].value == 1
    assert "nv_inference_pending_request_count" in fams
    assert re.search(r'^nv_inference_request_success\{model="ensemble",version="1"\} 1$', text, re.M)
    assert "_created" not in text


async def test_kv_cache_reuse_is_off_by_default_and_can_be_enabled(emulator: MakeEmulator) -> None:
    prompt = {"text_input": "a shared prompt that is long enough to fill blocks " * 20, "max_tokens": 1}
    reused = {}
    for reuse in (None, True):
        emu = await emulator("triton", model="ensemble", prefix_reuse=reuse)
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.post(emu.url + "/v2/models/ensemble/generate", json=prompt) as r:
                    assert r.status == 200
            async with s.get(emu.metrics_url + "/metrics") as r:
                fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
        reused[reuse] = next(x.value for x in fams["nv_trt_llm_kv_cache_block_metrics"].samples
                             if x.labels["kv_cache_block_type"] == "reused")
    assert reused[None] == 0
    assert reused[True] > 0
