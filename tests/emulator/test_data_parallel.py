"""`--data-parallel-size N` (issue 23): one emulated server of N engines, each with its own batches,
prefix cache, metrics series and KV-event publisher, pinned and validated as vLLM and SGLang do, and
balanced as their own DP front ends do when a request names no rank."""

from __future__ import annotations

import asyncio
import functools
import socket
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from backends.emulator import KvEventsConfig
from backends.emulator.dp import offset_endpoint
from backends.emulator.kv_zmq import ZmqKvPublisher
from tests.emulator.conftest import MakeEmulator
from tests.emulator.kv_harness import decode_batch
from tests.polling import until

BODY = {"model": "tiny-moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def chat(url: str, *, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(url + "/v1/chat/completions", json={**BODY, **extra}, headers=headers or {})


def subscribed(publisher: ZmqKvPublisher) -> bool:
    return publisher.subscriptions > 0


async def metrics_text(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as c:
        return (await c.get(url + "/metrics")).text


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


async def test_vllm_pins_on_its_header_and_refuses_a_rank_out_of_range(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm", data_parallel_size=2)
    pinned = await chat(emu.url, headers={"X-data-parallel-rank": "1"})
    assert pinned.status_code == 200
    assert pinned.headers["x-emulator-data-parallel-rank"] == "1"
    ignored = await chat(emu.url, headers={"X-data-parallel-rank": "one"})  # not an integer: vLLM ignores it
    assert ignored.status_code == 200
    bad = await chat(emu.url, headers={"X-data-parallel-rank": "2"})
    assert bad.status_code == 400
    assert bad.json()["error"] == {"message": "data_parallel_rank 2 is out of range [0, 2).",
                                   "type": "BadRequestError", "param": None, "code": 400}
    streamed = await chat(emu.url, headers={"X-data-parallel-rank": "-1"}, stream=True)
    assert streamed.status_code == 200  # the stream had started when the engine client raised
    assert "data_parallel_rank -1 is out of range [0, 2)." in streamed.text
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert emu.served_by_rank() == [1, 1]
    assert emu.ctx.pinned_requests == 1
    # one engine's series per rank, labelled as vLLM labels them
    text = await metrics_text(emu.url)
    ok = samples(text, "vllm:request_success_total")
    assert ok[(("engine", "1"), ("finished_reason", "length"), ("model_name", "tiny-moe"))] == 1
    assert ok[(("engine", "0"), ("finished_reason", "length"), ("model_name", "tiny-moe"))] == 1


async def test_vllm_balances_unpinned_requests_to_the_least_loaded_engine(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm", data_parallel_size=3, speed=5.0)
    long_ones = [asyncio.create_task(chat(emu.url, max_tokens=200)) for _ in range(2)]
    await emu.wait_until(lambda s: s.tokens_generated > 2)
    # waiting * 4 + running: the two long requests took engines 0 and 1, so engine 2 is the least loaded
    short = await chat(emu.url, max_tokens=1)
    assert short.headers["x-emulator-data-parallel-rank"] == "2"
    assert sorted(emu.served_by_rank()) == [1, 1, 1]
    for task in long_ones:
        task.cancel()
    await asyncio.gather(*long_ones, return_exceptions=True)


async def test_sglang_pins_on_its_body_fields_and_round_robins_the_rest(emulator: MakeEmulator) -> None:
    emu = await emulator("sglang", data_parallel_size=2)
    for field in ("routed_dp_rank", "data_parallel_rank"):  # the current name and the deprecated alias
        fields: dict[str, Any] = {field: 1}
        r = await chat(emu.url, **fields)
        assert r.headers["x-emulator-data-parallel-rank"] == "1"
    bad = await chat(emu.url, routed_dp_rank=2)
    assert bad.status_code == 400
    assert bad.json()["message"] == "routed_dp_rank=2 out of range [0, 2)"
    unpinned = [(await chat(emu.url)).headers["x-emulator-data-parallel-rank"] for _ in range(4)]
    assert unpinned == ["0", "1", "0", "1"]
    room = await chat(emu.url, bootstrap_room=7)  # a P/D prefill: the rank follows the room
    assert room.headers["x-emulator-data-parallel-rank"] == "1"
    text = await metrics_text(emu.url)
    running = samples(text, "sglang:num_running_reqs")
    assert {dict(k)["dp_rank"] for k in running} == {"0", "1"}


async def test_sglang_of_one_rank_ignores_rank_zero(emulator: MakeEmulator) -> None:
    emu = await emulator("sglang")
    assert (await chat(emu.url, routed_dp_rank=0)).status_code == 200
    assert (await chat(emu.url, routed_dp_rank=1)).status_code == 400
    assert "x-emulator-data-parallel-rank" not in (await chat(emu.url)).headers


def test_rank_endpoints_follow_vllms_offset_rule() -> None:
    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert offset_endpoint("tcp://*:5557", 1) == "tcp://*:5558"
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"


@pytest.mark.parametrize("runtime", ["vllm", "sglang"])
async def test_each_rank_publishes_its_own_events_on_port_plus_rank(emulator: MakeEmulator, runtime: str) -> None:
    zctx = zmq.asyncio.Context()
    subs = []
    for _ in range(50):  # two consecutive free ports
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        try:
            for r in range(2):
                sock = zctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                subs.append(sock)
                sock.bind(f"tcp://127.0.0.1:{port + r}")
            break
        except zmq.ZMQError:
            for sock in subs:
                sock.close()
            subs.clear()
    # a SUB sends its subscription only while the application uses it: receive from the start
    inboxes: list[asyncio.Queue[list[bytes]]] = [asyncio.Queue() for _ in subs]

    async def pump(sock: zmq.asyncio.Socket, inbox: asyncio.Queue[list[bytes]]) -> None:
        while True:
            inbox.put_nowait(await sock.recv_multipart())

    pumps = [asyncio.create_task(pump(sock, inbox)) for sock, inbox in zip(subs, inboxes, strict=True)]
    try:
        emu = await emulator(runtime, data_parallel_size=2, block_size=16,
                             kv_events=KvEventsConfig(endpoint=f"tcp://127.0.0.1:{port}"))
        for engine in emu.ctx.ranks:  # both publishers have the subscription (else ZMQ drops what they send)
            assert isinstance(engine.kv_publisher, ZmqKvPublisher)
            await until(functools.partial(subscribed, engine.kv_publisher))
        long_prompt = "a fairly long shared system prompt for this tenant " * 8
        for n in (0, 1):
            body: dict[str, Any] = {"routed_dp_rank": n} if runtime == "sglang" else {}
            headers = {"X-data-parallel-rank": str(n)} if runtime == "vllm" else {}
            reply = await chat(emu.url, headers=headers, messages=[{"role": "user", "content": f"{n} {long_prompt}"}],
                               **body)
            assert reply.status_code == 200
        for n, inbox in enumerate(inboxes):
            async with asyncio.timeout(10):
                batch = decode_batch(*await inbox.get())
            assert batch.dp_rank == n  # each rank's batches carry its rank, on its own port
            assert batch.seq == 0
            assert any(ev.kind == "BlockStored" for ev in batch.events)
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for sock in subs:
            sock.close()
        zctx.term()
