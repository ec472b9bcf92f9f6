"""The gateway as an OpenAI endpoint: the official SDK, sync and async, streaming and not, over real
sockets, in front of every runtime's emulator."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from .harness import Emulators, GatewayProcess, backend_entry

RUNTIMES = ["vllm", "sglang", "trtllm", "triton"]
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea."}]

StartGateway = Callable[..., GatewayProcess]


def one_backend(emulators: Emulators, gateway: StartGateway, runtime: str) -> GatewayProcess:
    emu = emulators.start(runtime)
    return gateway([backend_entry(f"{runtime}-a", emu, runtime)])


def client(gw: GatewayProcess) -> openai.OpenAI:
    return gw.client()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_chat_non_streaming_through_every_runtime(emulators: Emulators, gateway: StartGateway, runtime: str) -> None:
    gw = one_backend(emulators, gateway, runtime)
    raw = client(gw).chat.completions.with_raw_response.create(model="moe", messages=MESSAGES, max_tokens=8)
    reply = raw.parse()
    assert raw.headers["x-gateway-backend"] == f"{runtime}-a"
    assert raw.headers["x-gateway-runtime"] == runtime
    assert len(raw.headers["x-request-id"]) >= 16
    assert reply.model == "moe"
    assert reply.choices[0].message.content
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 0


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("include_usage", [True, False])
async def test_chat_streaming_through_every_runtime(
    emulators: Emulators, gateway: StartGateway, runtime: str, include_usage: bool
) -> None:
    gw = one_backend(emulators, gateway, runtime)
    aclient = openai.AsyncOpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
    stream = await aclient.chat.completions.create(
        model="moe", messages=MESSAGES, max_tokens=6, stream=True,
        stream_options={"include_usage": True} if include_usage else None,
    )
    chunks = [chunk async for chunk in stream]
    await aclient.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert all(c.model == "moe" for c in chunks)
    usages = [c.usage for c in chunks if c.usage is not None]
    if include_usage:
        assert len(usages) == 1
        assert usages[0].completion_tokens == 6
    else:
        assert usages == []
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    # the gateway saw the usage either way
    assert gw.metric("gateway_tokens_total", backend=f"{runtime}-a", kind="completion") == 6


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_completions_streaming_and_not(emulators: Emulators, gateway: StartGateway, runtime: str) -> None:
    gw = one_backend(emulators, gateway, runtime)
    c = client(gw)
    reply = c.completions.create(model="moe", prompt="The sea is", max_tokens=5)
    assert reply.choices[0].text
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 5
    parts = list(c.completions.create(model="moe", prompt="The sea is", max_tokens=5, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices)
    assert gw.metric("gateway_requests_total", backend=f"{runtime}-a", status="200") == 2


def test_client_request_id_is_echoed_but_the_engine_gets_an_id_of_the_gateway(
    emulators: Emulators, gateway: StartGateway
) -> None:
    """vLLM uses X-Request-Id as its engine request id and mishandles duplicates: two clients that
    send the same id must both be served, so upstream every attempt carries a gateway-unique id."""
    gw = one_backend(emulators, gateway, "vllm")
    ids = []
    for _ in range(2):
        raw = client(gw).chat.completions.with_raw_response.create(
            model="moe", messages=MESSAGES, max_tokens=2, extra_headers={"x-request-id": "req-abc123"}
        )
        assert raw.headers["x-request-id"] == "req-abc123"  # the client's own id comes back
        ids.append(raw.parse().id)  # vLLM builds its completion id from the X-Request-Id it received
    assert all(i.startswith("chatcmpl-") for i in ids)
    assert "chatcmpl-req-abc123" not in ids
    assert ids[0] != ids[1]


def test_models_health_ready_and_admin(emulators: Emulators, gateway: StartGateway) -> None:
    emu_v, emu_s = emulators.start("vllm"), emulators.start("sglang")
    gw = gateway(
        [backend_entry("v", emu_v, "vllm"), backend_entry("s", emu_s, "sglang")],
        routes=[{"model": "moe", "backends": ["v", "s"]}, {"model": "other", "backends": ["s"]}],
    )
    assert sorted(m.id for m in client(gw).models.list()) == ["moe", "other"]
    assert gw.get("/health").status_code == 200
    assert gw.get("/ready").status_code == 200
    admin = gw.get("/admin/backends").json()["backends"]
    by_name = {b["name"]: b for b in admin}
    assert by_name["v"]["runtime"] == "vllm"
    assert by_name["s"]["runtime"] == "sglang"
    assert all(b["healthy"] for b in admin)
    assert by_name["v"]["in_flight"] == 0
    # the engines' own load reports were scraped and normalised
    assert by_name["v"]["load"]["running"] is not None
    assert by_name["v"]["load"]["block_size"] is not None
    assert by_name["s"]["load"]["waiting"] is not None


@pytest.mark.parametrize("front", ["aiohttp", "native"])
def test_both_http_fronts_serve_generations_and_keep_alive_admin_requests(
    emulators: Emulators, gateway: StartGateway, front: str
) -> None:
    """`listen.front: aiohttp` serves generations through aiohttp's handlers; with the native front a
    keep-alive connection that asks for something else first is handed to aiohttp and still serves
    generations afterwards (the SDK's client reuses one connection for all of these)."""
    gw = gateway([backend_entry("v", emulators.start("vllm"), "vllm")], listen={"front": front})
    sdk = client(gw)
    assert [m.id for m in sdk.models.list()] == ["moe"]  # a non-generation request first
    reply = sdk.chat.completions.create(model="moe", messages=MESSAGES, max_tokens=4)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 4
    chunks = list(sdk.chat.completions.create(model="moe", messages=MESSAGES, max_tokens=4, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with pytest.raises(openai.NotFoundError):  # errors are the same OpenAI JSON through either front
        sdk.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=4)
