"""The official OpenAI SDK (sync and async, streaming and not, chat and completions) accepts the
three OpenAI-compatible faces."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.emulator.conftest import MakeEmulator

RUNTIMES = ["vllm", "sglang", "trtllm"]
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is a good book about the sea?"}]


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_async_sdk_chat_and_completions(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime)
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    reply = await client.chat.completions.create(model="tiny-moe", messages=MSG, max_tokens=5)
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 5
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens is not None
    comp = await client.completions.create(model="tiny-moe", prompt="Once upon a time", max_tokens=4)
    assert comp.choices[0].text
    assert comp.usage is not None
    assert comp.usage.completion_tokens == 4

    stream = await client.chat.completions.create(
        model="tiny-moe", messages=MSG, max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text
    assert finish == "length"
    assert usage is not None
    assert usage.completion_tokens == 6

    cstream = await client.completions.create(model="tiny-moe", prompt="Once upon", max_tokens=3, stream=True)
    pieces = [c.choices[0].text async for c in cstream if c.choices]
    assert len([p for p in pieces if p]) == 3
    await client.close()


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_sync_sdk_streaming_and_not(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime)

    def use_sync_client() -> tuple[str, int, str, int]:
        with openai.OpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0) as client:
            reply = client.chat.completions.create(model="tiny-moe", messages=MSG, max_tokens=3)
            stream = client.chat.completions.create(
                model="tiny-moe", messages=MSG, max_tokens=4, stream=True)
            n = sum(1 for c in stream if c.choices and c.choices[0].delta.content)
            comp = client.completions.create(model="tiny-moe", prompt="Once upon a time", max_tokens=2)
            cstream = client.completions.create(model="tiny-moe", prompt="Once", max_tokens=5, stream=True)
            cn = sum(1 for c in cstream if c.choices and c.choices[0].text)
            return reply.choices[0].message.content or "", n, comp.choices[0].text, cn

    text, n, ctext, cn = await asyncio.to_thread(use_sync_client)
    assert text
    assert n == 4
    assert ctext
    assert cn == 5


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_sdk_raises_the_right_errors(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime, fail_first=1, fail_status=503)
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model="tiny-moe", messages=MSG, max_tokens=2)
    long: list[ChatCompletionMessageParam] = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="tiny-moe", messages=long, max_tokens=2)
    await client.close()


async def test_n_choices_stream_interleaved(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm")
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny-moe", messages=MSG, max_tokens=3, n=2, stream=True)
    counts = [0, 0]
    async for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                counts[c.index] += 1
    assert counts == [3, 3]
    await client.close()


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"},
    {"messages": ["not a message"]},
    {"messages": [{"role": "user", "content": "hi"}], "n": [2]},
    {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": "yes"},
])
async def test_malformed_fields_are_400_not_500(emulator: MakeEmulator, runtime: str, body: dict[str, object]) -> None:
    emu = await emulator(runtime)
    async with aiohttp.ClientSession() as s, s.post(emu.url + "/v1/chat/completions", json=body) as r:
        assert r.status in (200, 400), await r.text()
        if r.status == 400:
            err = await r.json()
            assert "error" in err or err.get("object") == "error"
        else:
            await r.read()


async def test_vllm_clamps_max_tokens_to_the_context_and_reports_orca_load(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm", max_model_len=64)
    body = {"prompt": "one two three four five six seven eight nine ten", "max_tokens": 60}
    async with aiohttp.ClientSession() as s, s.post(
        emu.url + "/v1/completions", json=body, headers={"endpoint-load-metrics-format": "TEXT"}
    ) as r:
        assert r.status == 200  # vLLM 0.32 clamps instead of rejecting
        usage = (await r.json())["usage"]
        orca = r.headers["endpoint-load-metrics"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    assert orca.startswith("TEXT named_metrics.kv_cache_usage_perc=")
    assert "named_metrics.num_requests_waiting=" in orca
