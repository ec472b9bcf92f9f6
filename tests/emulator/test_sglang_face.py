"""SGLang-specific protocol details (spec section 3)."""

from __future__ import annotations

import re

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from tests.emulator.conftest import MakeEmulator

MSG = [{"role": "user", "content": "hi"}]


async def test_chat_shapes_ids_and_echoed_model(emulator: MakeEmulator) -> None:
    emu = await emulator("sglang")
    async with aiohttp.ClientSession() as s:
        async with s.post(emu.url + "/v1/chat/completions",
                          json={"model": "anything", "messages": MSG, "max_tokens": 3}) as r:
            body = await r.json()
        assert re.fullmatch(r"[0-9a-f]{32}", body["id"])
        assert body["model"] == "anything"
        assert list(body) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
        assert body["choices"][0]["message"]["reasoning_content"] is None
        assert list(body["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
                                       "reasoning_tokens", "completion_tokens_details"]
        async with s.post(emu.url + "/v1/chat/completions", json={
                "messages": MSG, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}) as r:
            raw = await r.read()
    events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert raw.endswith(b"data: [DONE]\n\n")
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert all("reasoning_content" in d and d["reasoning_content"] is None for d in deltas)
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1
    assert finish[0]["choices"][0]["delta"] == {"reasoning_content": None}
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 2


async def test_cache_report_and_flat_errors(emulator: MakeEmulator) -> None:
    emu = await emulator("sglang", max_model_len=512)
    system = {"role": "system", "content": "You are a helpful assistant for a bookshop. " * 10}
    async with aiohttp.ClientSession() as s:
        cached = []
        for q in ("first question", "second question"):
            async with s.post(emu.url + "/v1/chat/completions", json={
                    "messages": [system, {"role": "user", "content": q}], "max_tokens": 2}) as r:
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[0] == 0
        assert cached[1] > 50
        async with s.post(emu.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "word " * 600}]}) as r:
            assert r.status == 400
            err = await r.json()
        assert err["object"] == "error"
        assert err["code"] == 400
        assert err["message"].startswith("The input (")
        assert "context length (512 tokens)" in err["message"]


async def test_native_generate_health_loads_and_metrics(emulator: MakeEmulator) -> None:
    emu = await emulator("sglang")
    async with aiohttp.ClientSession() as s:
        async with s.post(emu.url + "/generate", json={"text": "The capital of France is",
                                                       "sampling_params": {"max_new_tokens": 4}}) as r:
            gen = await r.json()
        assert len(gen["output_ids"]) == 4
        assert gen["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert gen["meta_info"]["e2e_latency"] > 0
        async with s.post(emu.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": "x"}}) as r:
            assert r.status == 400
        async with s.post(emu.url + "/generate", json={"text": "x", "stream": True,
                                                       "sampling_params": {"max_new_tokens": 3}}) as r:
            raw = await r.read()
        events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
        assert [len(e["output_ids"]) for e in events] == [1, 2, 3]  # cumulative
        async with s.get(emu.url + "/v1/models/nope") as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"
        for path in ("/health", "/health_generate", "/ready", "/ping", "/model_info", "/get_model_info",
                     "/server_info", "/v1/models/tiny-moe"):
            async with s.get(emu.url + path) as r:
                assert r.status == 200, path
        async with s.get(emu.url + "/v1/loads") as r:
            loads = (await r.json())["loads"][0]
        assert {"num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens", "token_usage"} <= set(loads)
        async with s.get(emu.url + "/metrics") as r:
            text = await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
                 "sglang:gen_throughput", "sglang:prompt_tokens", "sglang:generation_tokens",
                 "sglang:cached_tokens", "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds"):
        assert name in fams, name
    assert "_created" not in text
    line = next(ln for ln in text.splitlines() if ln.startswith("sglang:num_running_reqs{"))
    keys = re.findall(r'(\w+)="', line)
    assert keys == sorted(keys)
    gen_tokens = sum(s.value for s in fams["sglang:generation_tokens"].samples)
    assert gen_tokens >= 7


async def test_health_is_503_while_starting(emulator: MakeEmulator) -> None:
    emu = await emulator("sglang", not_ready_for_s=60)
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/ready"):
            async with s.get(emu.url + path) as r:
                assert r.status == 503


async def test_flush_cache_empties_the_radix_tree(emulator: MakeEmulator) -> None:
    emu = await emulator("sglang")
    body = {"messages": [{"role": "user", "content": "a long shared question " * 20}], "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        async with s.post(emu.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
        async with s.get(emu.url + "/flush_cache") as r:
            assert r.status == 200
            assert (await r.text()).startswith("Cache flushed.")
        async with s.post(emu.url + "/v1/chat/completions", json=body) as r:
            assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_metrics_negotiate_like_make_asgi_app(emulator: MakeEmulator) -> None:
    for runtime, path in (("sglang", "/metrics"), ("trtllm", "/prometheus/metrics")):
        emu = await emulator(runtime)
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
        async with aiohttp.ClientSession() as s:
            async with s.get(emu.url + path, headers={"Accept": accept}) as r:
                assert r.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
                assert (await r.text()).endswith("# EOF\n")
            async with s.get(emu.url + path) as r:
                assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            async with s.get(emu.url + path, headers={"Accept-Encoding": "gzip"}) as r:
                assert r.status == 200
                assert "sglang" in await r.text() or "trtllm" in await r.text()
