"""The KV-event intake on real ZMQ sockets, against a stub publisher speaking vLLM's framing where the
emulators cannot (they run one data-parallel rank): one SUB per backend bound on every rank's port,
ranks tracked apart, undecodable messages counted and skipped, tasks following the config.

The stub is an XPUB socket: it receives the gateway's subscription before publishing, so no batch
is lost to ZMQ's slow-joiner window and the test needs no sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.kvcache import KvCaches, KvIntake
from gateway.kvcache.intake import relay_endpoint
from gateway.kvcache.relay import KvRelay
from gateway.kvcache.trtllm_source import TrtllmIntake
from gateway.retrying import Backoff
from gateway.settings import Backend
from tests.polling import until

BS = 16


def two_free_ports() -> int:
    """A port p with p and p + 1 free (data-parallel rank 1 publishes on p + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = int(a.getsockname()[1])
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise RuntimeError("no two consecutive free ports")


def stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "medium": "GPU", "lora_name": None, "extra_keys": [None] * len(hashes)}


class Publisher:
    """One engine rank's publisher: connects to the gateway's bound endpoint, as vLLM does."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, rank: int) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.rank = rank
        self.seq = 0

    async def subscribed(self) -> None:
        async with asyncio.timeout(10):
            message = await self.sock.recv()
        assert message == b"\x01kv"  # subscribe, topic "kv"

    async def publish(self, *events: dict[str, Any]) -> None:
        payload = msgpack.packb([1.0, list(events), self.rank])
        await self.sock.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1




@pytest.fixture
async def intake() -> AsyncIterator[tuple[KvIntake, KvCaches]]:
    caches = KvCaches(clock=asyncio.get_running_loop().time)
    async with aiohttp.ClientSession() as session:
        kv = KvIntake(caches, session)
        yield kv, caches
        await kv.close()


def backend(name: str, port: int, **kv: Any) -> Backend:
    return Backend.model_validate({
        "name": name, "runtime": "vllm", "url": "http://127.0.0.1:9", "model": "m",
        "kv_events": {"endpoint": f"tcp://127.0.0.1:{port}", "bind": True, "topic": "kv", **kv},
    })


async def test_data_parallel_ranks_are_received_and_tracked_apart(intake: tuple[KvIntake, KvCaches]) -> None:
    kv, caches = intake
    port = two_free_ports()
    kv.reconcile([backend("dp", port, data_parallel_size=2)], {})
    ctx = zmq.asyncio.Context()
    ranks = [Publisher(ctx, f"tcp://127.0.0.1:{port + r}", r) for r in range(2)]
    try:
        for p in ranks:
            await p.subscribed()
        tokens = list(range(100, 100 + 3 * BS))
        await ranks[0].publish(stored([11, 12], tokens[: 2 * BS]))
        await ranks[1].publish(stored([21], tokens[:BS]))
        await ranks[1].publish(stored([22, 23], tokens[BS : 3 * BS], parent=21))
        cache = caches.get("dp")
        assert cache is not None
        await until(lambda: cache.counter == 3)
        assert cache.live
        assert sorted(cache.ranks) == [0, 1]
        assert [len(cache.ranks[r].index) for r in (0, 1)] == [2, 3]
        assert [cache.ranks[r].next_seq for r in (0, 1)] == [1, 2]
        # garbage on the wire is counted and skipped; the next batch still arrives
        await ranks[0].sock.send_multipart([b"kv", b"\x00" * 8, b"\xc1not msgpack"])
        await ranks[0].publish({"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"})
        await until(lambda: len(cache.ranks[0].index) == 1)
        assert cache.stats.decode_errors == 1
        assert cache.live  # the undecodable message had no sequence number to lose
    finally:
        for p in ranks:
            p.sock.close(linger=0)
        ctx.term()


async def test_reconcile_follows_the_config(intake: tuple[KvIntake, KvCaches]) -> None:
    kv, caches = intake
    port = two_free_ports()
    kv.reconcile([backend("a", port)], {})
    first = caches.get("a")
    assert first is not None
    kv.reconcile([backend("a", port)], {})  # unchanged: the same cache carries on
    assert caches.get("a") is first
    kv.reconcile([backend("a", port + 1)], {})  # another endpoint: another engine, a new cache
    second = caches.get("a")
    assert second is not None
    assert second is not first
    kv.reconcile([], {})
    assert caches.get("a") is None
    # the endpoint is free again: its socket was closed with its task
    def port_free() -> bool:
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            return False
        return True

    await until(port_free, within_s=2.0)  # else the intake's socket still holds its port


async def test_a_port_already_bound_is_logged_and_retried_until_it_is_free(caplog: pytest.LogCaptureFixture) -> None:
    """An address still held (by a gateway that is stopping, say): the intake logs it, routing
    falls back, and the bind is retried with backoff until it succeeds; the engine is then heard."""
    caches = KvCaches(clock=asyncio.get_running_loop().time)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = int(busy.getsockname()[1])
    ctx = zmq.asyncio.Context()
    async with aiohttp.ClientSession() as session:
        kv = KvIntake(caches, session, backoff=Backoff(0.05, 0.2, jitter=0.0))
        try:
            kv.reconcile([backend("b", port)], {})
            cache = caches.get("b")
            assert cache is not None
            await until(lambda: caplog.text.count("cannot bind KV events endpoint") >= 2)  # retried
            assert "retrying in" in caplog.text
            assert not cache.live
            busy.close()
            engine = Publisher(ctx, f"tcp://127.0.0.1:{port}", 0)
            try:
                await engine.subscribed()  # the intake bound the address at last
                await engine.publish(stored([1], list(range(BS))))
                await until(lambda: cache.live)
            finally:
                engine.sock.close(linger=0)
        finally:
            busy.close()
            await kv.close()
            ctx.term()


async def test_failed_trtllm_polls_back_off_and_start_again_after_an_answer() -> None:
    """`/kv_cache_events` failing: each failed poll waits longer (the injected sleep records it),
    and the first answer that holds events resets the backoff."""
    answers = [503, 503, 503, 200, 500, 200]
    served: list[int] = []

    async def events(_: web.Request) -> web.Response:
        status = answers[min(len(served), len(answers) - 1)]
        served.append(status)
        body = [{"event_id": len(served), "data": {"type": "removed", "block_hashes": [1]}}] if status == 200 else []
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_post("/kv_cache_events", events)
    pauses: list[float] = []

    async def sleep(s: float) -> None:
        pauses.append(s)
        await asyncio.sleep(0)

    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        got: list[bytes] = []

        def deliver(body: bytes) -> int:
            got.append(body)
            return 1

        poller = TrtllmIntake(str(server.make_url("/")), {}, deliver, session, asyncio.get_running_loop().time,
                              sleep, backoff=Backoff(1.0, 8.0, jitter=0.0))
        task = asyncio.create_task(poller.run())
        try:
            await until(lambda: len(served) >= len(answers))
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert pauses[:4] == [1.0, 2.0, 4.0, 1.0]  # three failures back off; after an answer, from the start
    assert len(got) >= 2


async def test_a_relay_that_cannot_bind_is_retried_until_it_is_free(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The supervisor's relay of a bound endpoint (`--workers N`): an address still held is logged
    and retried with backoff; once free, the engine's batches reach the workers' side unchanged."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = int(busy.getsockname()[1])
    b = backend("r", port)
    ctx = zmq.asyncio.Context()
    worker = ctx.socket(zmq.SUB)
    worker.setsockopt(zmq.LINGER, 0)
    worker.setsockopt(zmq.SUBSCRIBE, b"")
    async with aiohttp.ClientSession() as session:
        relay = KvRelay(tmp_path, session, backoff=Backoff(0.05, 0.2, jitter=0.0))
        try:
            relay.reconcile([b], {})
            await until(lambda: caplog.text.count("relaying KV events to the workers failed") >= 2)
            assert "cannot bind" in caplog.text
            busy.close()
            worker.connect(relay_endpoint(tmp_path, "r"))
            engine = Publisher(ctx, f"tcp://127.0.0.1:{port}", 0)
            try:
                await engine.subscribed()  # the relay bound the engine's address at last
                got: list[list[bytes]] = []

                async def relayed_once() -> bool:
                    await engine.publish(stored([1], list(range(BS))))
                    try:
                        async with asyncio.timeout(0.2):
                            got.append(await worker.recv_multipart())
                    except TimeoutError:
                        return False
                    return True

                async with asyncio.timeout(20):  # (the worker's subscription reaches the relay when it does)
                    while not await relayed_once():
                        pass
                topic, _, payload = got[0]  # [topic, seq, payload], as the engine sent it
                assert topic == b"kv"
                assert msgpack.unpackb(payload)[1][0]["block_hashes"] == [1]
            finally:
                engine.sock.close(linger=0)
        finally:
            busy.close()
            await relay.close()
            worker.close(linger=0)
            ctx.term()
