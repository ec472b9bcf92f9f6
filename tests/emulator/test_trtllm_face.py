"""trtllm-serve protocol quirks (spec 4.1)."""

from __future__ import annotations

import re

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from tests.emulator.conftest import MakeEmulator

MSG = [{"role": "user", "content": "hi"}]


async def test_stream_framing_ids_and_default_usage(emulator: MakeEmulator) -> None:
    emu = await emulator("trtllm")
    async with aiohttp.ClientSession() as s, s.post(emu.url + "/v1/chat/completions", json={
            "model": "m", "messages": MSG, "max_tokens": 3, "stream": True, "stream_options": {}}) as r:
        raw = await r.read()
    first, _, rest = raw.partition(b" \n\n")
    assert first.startswith(b"data: {")
    assert b"\n\n" not in first
    rest_events = [orjson.loads(e[6:]) for e in rest.split(b"\n\n") if e and e != b"data: [DONE]"]
    events = [orjson.loads(first[6:]), *rest_events]
    assert raw.endswith(b"data: [DONE]\n\n")
    assert re.fullmatch(r"chatcmpl-\d+", events[0]["id"])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # include_usage defaults to true


async def test_strict_schema_errors(emulator: MakeEmulator) -> None:
    emu = await emulator("trtllm")
    async with aiohttp.ClientSession() as s:
        async with s.post(emu.url + "/v1/chat/completions", json={"messages": MSG, "guided_json": {}}) as r:
            assert r.status == 400
            err = await r.json()
        assert isinstance(err["error"], str)
        assert "guided_json" in err["error"]
        assert "extra_forbidden" in err["error"]
        async with s.post(emu.url + "/v1/chat/completions", json={
                "messages": MSG, "stream_options": {"include_usage": True}}) as r:
            assert r.status == 400
            assert "stream_options can only be set if stream is true" in (await r.json())["error"]


async def test_usage_always_reports_cached_tokens(emulator: MakeEmulator) -> None:
    emu = await emulator("trtllm")
    system = {"role": "system", "content": "You are a helpful assistant for a bookshop. " * 20}
    cached = []
    async with aiohttp.ClientSession() as s:
        for q in ("one", "two"):
            async with s.post(emu.url + "/v1/chat/completions", json={
                    "messages": [system, {"role": "user", "content": q}], "max_tokens": 2}) as r:
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0
    assert cached[1] > 0
    assert cached[1] % 32 == 0


async def test_iteration_stats_are_drained_and_prometheus_parses(emulator: MakeEmulator) -> None:
    emu = await emulator("trtllm")
    async with aiohttp.ClientSession() as s:
        async with s.post(emu.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}) as r:
            assert r.status == 200
        async with s.get(emu.url + "/metrics") as r:
            stats = await r.json()
        assert len(stats) >= 3
        kv = stats[-1]["kvCacheStats"]
        assert {"maxNumBlocks", "freeNumBlocks", "usedNumBlocks", "tokensPerBlock", "reusedBlocks",
                "missedBlocks", "cacheHitRate"} <= set(kv)
        assert {"numActiveRequests", "numQueuedRequests", "iterLatencyMS"} <= set(stats[-1])
        async with s.get(emu.url + "/metrics") as r:
            assert await r.json() == []  # destructive read
        for path, want in (("/health", 200), ("/health_generate", 200), ("/version", 200), ("/v1/models", 200)):
            async with s.get(emu.url + path) as r:
                assert r.status == want, path
        async with s.get(emu.url + "/prometheus/metrics") as r:
            fams = {f.name for f in text_string_to_metric_families(await r.text())}
    assert {"trtllm_request_success", "trtllm_time_to_first_token_seconds", "trtllm_kv_cache_hit_rate",
            "trtllm_num_requests_running", "trtllm_num_requests_waiting"} <= fams
