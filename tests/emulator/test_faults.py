"""Fault knobs over real sockets: injected failures, hangs, mid-stream deaths, slow starts, full
queues, and client disconnects aborting the engine request."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from backends.emulator import Faults, RunningEmulator
from backends.emulator.faults import FaultGate
from tests.emulator.conftest import MakeEmulator

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny-moe", "messages": MSG, "max_tokens": 3}


async def drain(stream: Any) -> None:
    async for _ in stream:
        pass


def generate_call(emu: RunningEmulator, **extra: Any) -> tuple[str, dict[str, Any]]:
    if emu.runtime == "triton":
        return emu.url + "/v2/models/tiny-moe/generate", {"text_input": "hi", "max_tokens": 3}
    return emu.url + "/v1/chat/completions", {**CHAT, **extra}


@pytest.mark.parametrize(("runtime", "shape"), [
    ("vllm", lambda b: b["error"]["code"] == 503),
    ("sglang", lambda b: b["object"] == "error" and b["code"] == 503),
    ("trtllm", lambda b: b["object"] == "error" and b["code"] == 503),
    ("triton", lambda b: isinstance(b["error"], str)),
])
async def test_fail_first_then_serve(emulator: MakeEmulator, runtime: str, shape: Any) -> None:
    emu = await emulator(runtime, fail_first=2, fail_status=503)
    url, body = generate_call(emu)
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(url, json=body) as r:
                statuses.append(r.status)
                if r.status != 200:
                    assert shape(await r.json())
    assert statuses == [503, 503, 200]
    assert emu.stats.failed_injected == 2
    assert emu.stats.requests_received == 3


async def test_fail_rate_is_seeded(emulator: MakeEmulator) -> None:
    patterns = []
    for _ in range(2):
        emu = await emulator("vllm", fail_rate=0.5, fail_status=500, seed=7)
        url, body = generate_call(emu, max_tokens=1)
        async with aiohttp.ClientSession() as s:
            pattern = []
            for _ in range(30):
                async with s.post(url, json=body) as r:
                    pattern.append(r.status)
        patterns.append(pattern)
    assert patterns[0] == patterns[1]
    assert 5 <= patterns[0].count(500) <= 25


async def test_hang_never_sends_a_first_token(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm", hang=True)
    url, body = generate_call(emu, stream=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
        with pytest.raises(TimeoutError):
            async with s.post(url, json=body) as r:
                await r.content.readany()
    assert emu.stats.requests_received == 1
    assert emu.stats.tokens_generated == 0


@pytest.mark.parametrize("runtime", ["vllm", "sglang", "trtllm", "triton"])
async def test_client_disconnect_aborts_the_engine_request(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime, speed=5.0)
    if runtime == "triton":
        url, body = emu.url + "/v2/models/tiny-moe/generate_stream", {"text_input": "hi", "max_tokens": 500}
    else:
        url, body = generate_call(emu, stream=True, max_tokens=500)
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url, json=body)
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")
        resp.close()  # drop the connection mid-stream
    await emu.wait_until(lambda st: st.aborted >= 1)
    assert emu.stats.completed == 0
    assert emu.ctx.driver.engine.idle


async def test_abort_is_counted_in_vllm_metrics(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm", speed=5.0)
    async with aiohttp.ClientSession() as s:
        resp = await s.post(emu.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 500, "stream": True})
        await resp.content.readuntil(b"\n\n")
        resp.close()
        await emu.wait_until(lambda st: st.aborted >= 1)
        async with s.get(emu.url + "/metrics") as r:
            fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
    abort = [x for x in fams["vllm:request_success"].samples
             if x.name.endswith("_total") and x.labels["finished_reason"] == "abort"]
    assert abort[0].value == 1


@pytest.mark.parametrize("runtime", ["vllm", "sglang", "trtllm", "triton"])
async def test_die_after_tokens_closes_the_connection_without_a_final_event(
    emulator: MakeEmulator, runtime: str
) -> None:
    emu = await emulator(runtime, die_after_tokens=2)
    if runtime == "triton":
        url, body = emu.url + "/v2/models/tiny-moe/generate_stream", {"text_input": "hi", "max_tokens": 10}
    else:
        url, body = generate_call(emu, stream=True, max_tokens=10)
    received: list[bytes] = []

    async def read_all(s: aiohttp.ClientSession) -> None:
        async with s.post(url, json=body) as r:
            async for chunk in r.content.iter_any():
                received.append(chunk)

    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientError):
            await read_all(s)
    assert b"[DONE]" not in b"".join(received)
    assert emu.stats.died_mid_stream == 1
    await emu.wait_until(lambda st: st.aborted >= 1)


async def test_mid_stream_error_event_then_done(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm", error_after_tokens=1)
    async with aiohttp.ClientSession() as s, s.post(emu.url + "/v1/chat/completions",
                                                    json={**CHAT, "stream": True}) as r:
        raw = await r.read()
    assert raw.endswith(
        b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, '
        b'"code": 500}}\n\ndata: [DONE]\n\n')
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    stream = await client.chat.completions.create(model="tiny-moe", messages=MSG, stream=True)
    with pytest.raises(openai.APIError):
        await drain(stream)
    await client.close()


@pytest.mark.parametrize(("runtime", "health"), [("vllm", "/health"), ("trtllm", "/health")])
async def test_not_ready_fails_health_and_requests(emulator: MakeEmulator, runtime: str, health: str) -> None:
    emu = await emulator(runtime, not_ready_for_s=60)
    url, body = generate_call(emu)
    async with aiohttp.ClientSession() as s:
        async with s.get(emu.url + health) as r:
            assert r.status == 503
        async with s.post(url, json=body) as r:
            assert r.status == 503
    assert emu.stats.rejected_not_ready == 1


def test_fault_gate_becomes_ready_after_the_delay() -> None:
    now = [100.0]
    gate = FaultGate(Faults(not_ready_for_s=5.0), seed=0, clock=lambda: now[0])
    assert not gate.ready()
    now[0] = 105.0
    assert gate.ready()


@pytest.mark.parametrize(("runtime", "message"), [
    ("vllm", "The engine is currently busy and cannot accept new requests. Please try again later or on a "
             "different instance."),
    ("sglang", "The request queue is full."),
])
async def test_full_queue_is_refused_with_503(emulator: MakeEmulator, runtime: str, message: str) -> None:
    emu = await emulator(runtime, speed=0.001, max_queue=2)  # the first iteration never ends
    url, body = generate_call(emu, max_tokens=50)
    async with aiohttp.ClientSession() as s:

        async def call() -> tuple[int, Any]:
            async with s.post(url, json=body) as r:
                return r.status, await r.json()

        tasks = [asyncio.create_task(call()) for _ in range(30)]
        # Accepted requests never finish at this speed, so the first to complete is a rejection.
        finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=10)
        done = [t.result() for t in finished]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    rejected = [b for status, b in done if status == 503]
    assert rejected
    err = rejected[0].get("error", rejected[0])
    assert err["message"] == message


@pytest.mark.parametrize("runtime", ["sglang", "trtllm"])
async def test_mid_stream_error_event_other_runtimes(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime, error_after_tokens=2)
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    stream = await client.chat.completions.create(model="tiny-moe", messages=MSG, max_tokens=5, stream=True)
    with pytest.raises(openai.APIError):
        await drain(stream)
    await client.close()
    await emu.wait_until(lambda st: st.aborted >= 1)


async def test_sglang_queue_full_in_a_stream_is_an_error_chunk(emulator: MakeEmulator) -> None:
    emu = await emulator("sglang", max_queue=0)  # every request finds the queue full
    async with aiohttp.ClientSession() as s, s.post(emu.url + "/v1/chat/completions",
                                                    json={**CHAT, "stream": True}) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw == (b'data: {"error":{"object":"error","message":"The request queue is full.",'
                   b'"type":"SERVICE_UNAVAILABLE","param":null,"code":503}}\n\ndata: [DONE]\n\n')


async def test_stop_cuts_in_flight_requests_quickly(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm", hang=True)
    url, body = generate_call(emu, stream=True)
    async with aiohttp.ClientSession() as s:
        pending = asyncio.create_task(s.post(url, json=body))
        await emu.wait_until(lambda st: st.requests_received == 1)
        async with asyncio.timeout(5):  # aiohttp's default graceful shutdown would wait 60 s
            await emu.stop()
        resp = await pending
        with pytest.raises(aiohttp.ClientError):
            await resp.read()
        resp.close()
