"""The KV-event intake on real ZMQ sockets, against a stub publisher speaking vLLM's framing where the
emulators cannot (they run one data-parallel rank): one SUB per backend bound on every rank's port,
ranks tracked apart, undecodable messages counted and skipped, tasks following the config.

The stub is an XPUB socket: it receives the gateway's subscription before publishing, so no batch
is lost to ZMQ's slow-joiner window and the test needs no sleeps."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from gateway.kvcache import KvCaches, KvIntake
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


async def test_a_port_already_bound_is_logged_and_routing_falls_back(intake: tuple[KvIntake, KvCaches],
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    kv, caches = intake
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = int(busy.getsockname()[1])
        kv.reconcile([backend("b", port)], {})
    cache = caches.get("b")
    assert cache is not None
    assert not cache.live
    assert "cannot bind KV events endpoint" in caplog.text
