"""A KV-event consumer for tests: a ZMQ SUB bound on loopback (the emulator's PUB connects, as
vLLM's and SGLang's do), decoding every encoding the emulator speaks into one event model, and a
replica of the cache built only from the events (what a router like the gateway would keep)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

END_SEQ = -1


@dataclass(frozen=True)
class Ev:
    kind: str  # "BlockStored", "BlockRemoved", "AllBlocksCleared"
    hashes: tuple[int, ...] = ()
    parent: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0


@dataclass(frozen=True)
class Batch:
    topic: bytes
    seq: int
    ts: float
    events: tuple[Ev, ...]
    dp_rank: int
    raw_events: tuple[Any, ...]


def decode_event(raw: Any) -> Ev:
    """A tagged map (vLLM 0.32) or a positional array with the class name first (older vLLM, SGLang)."""
    if isinstance(raw, dict):
        kind = raw["type"]
        if kind == "BlockStored":
            return Ev(kind, tuple(raw["block_hashes"]), raw["parent_block_hash"], tuple(raw["token_ids"]),
                      raw["block_size"])
        if kind == "BlockRemoved":
            return Ev(kind, tuple(raw["block_hashes"]))
        return Ev(kind)
    kind = raw[0]
    if kind == "BlockStored":
        return Ev(kind, tuple(raw[1]), raw[2], tuple(raw[3]), raw[4])
    if kind == "BlockRemoved":
        return Ev(kind, tuple(raw[1]))
    return Ev(kind)


def decode_batch(topic: bytes, seq: bytes, payload: bytes) -> Batch:
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    return Batch(topic, int.from_bytes(seq, "big", signed=True), ts, tuple(decode_event(e) for e in events), rank,
                 tuple(events))


class Replica:
    """The resident blocks as the events describe them, checking they are self-consistent: a store
    names a resident parent (or none), never re-stores a resident block; a removal names a resident one."""

    def __init__(self) -> None:
        self.resident: set[int] = set()
        self.tokens: dict[int, tuple[int, ...]] = {}
        self.stored = 0
        self.removed = 0
        self.cleared = 0

    def apply(self, events: Iterable[Ev]) -> None:
        for ev in events:
            if ev.kind == "BlockStored":
                assert ev.parent is None or ev.parent in self.resident, ev
                assert len(ev.token_ids) == ev.block_size * len(ev.hashes), ev
                for i, h in enumerate(ev.hashes):
                    assert h not in self.resident, ev
                    self.resident.add(h)
                    self.tokens[h] = ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]
                    self.stored += 1
            elif ev.kind == "BlockRemoved":
                for h in ev.hashes:
                    assert h in self.resident, ev
                    self.resident.discard(h)
                    self.removed += 1
            else:
                self.resident.clear()
                self.cleared += 1

    def leading_hits(self, hashes: Iterable[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.resident:
                break
            n += 1
        return n


class Subscriber:
    """`async with Subscriber(topic) as sub:` binds on 127.0.0.1 (a free port, `sub.endpoint`) and
    receives in the background from the start, as a real consumer does: a SUB socket only sends its
    subscription once it has processed the new connection, so one left idle would make the
    publisher drop what it sends first (ZMQ's "slow joiner").

    With `replay_endpoint`, batches missed before the first one received (the subscription was still
    in flight) are fetched from the publisher's replay socket, as a consumer does at startup."""

    def __init__(self, topic: bytes = b"", *, replay_endpoint: str | None = None, with_topic: bool = True) -> None:
        self.topic = topic
        self.replay_endpoint = replay_endpoint
        self.with_topic = with_topic
        self._zctx = zmq.asyncio.Context()
        self.sock = self._zctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.batches: list[Batch] = []  # this publisher's batches (`new_publisher()` starts over)
        self.history: list[list[Batch]] = []
        self._inbox: asyncio.Queue[Batch] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Subscriber:
        self._pump = asyncio.get_running_loop().create_task(self._receive())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
        self._zctx.term()

    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            assert len(frames) == 3, frames
            self._inbox.put_nowait(decode_batch(*frames))

    async def connected(self, timeout_s: float = 5.0) -> None:
        """Wait until a publisher has connected and completed the ZMTP handshake."""
        async with asyncio.timeout(timeout_s):
            await recv_monitor_message(self._monitor)

    def new_publisher(self) -> None:
        """A new publisher (a restarted emulator) connects: its sequence starts again."""
        self.history.append(self.batches)
        self.batches = []

    async def receive_until(self, next_seq: int, timeout_s: float = 5.0) -> list[Batch]:
        """Receive until the batch `next_seq - 1` (the publisher's last) or a later one arrived;
        returns the batches received by this call, in order.

        With a replay endpoint, batches the publisher sent before our subscription reached it are
        fetched from its replay socket: when the first one received is not the first sent, or when
        none has arrived for a moment (the publisher sent all it had into the slow joiner's gap, and
        no later batch would reveal it). A gap after the first batch received is left for the test
        to see, as a consumer must detect it."""
        got: list[Batch] = []
        async with asyncio.timeout(timeout_s):
            while not self.batches or self.batches[-1].seq < next_seq - 1:
                idle_s = 0.25 if not self.batches and self.replay_endpoint is not None else None
                try:
                    batch = await asyncio.wait_for(self._inbox.get(), idle_s)
                except TimeoutError:
                    assert self.replay_endpoint is not None
                    self._extend(await replay(self.replay_endpoint, 0, with_topic=self.with_topic), got)
                    continue
                if not self.batches and batch.seq > 0 and self.replay_endpoint is not None:
                    missed = await replay(self.replay_endpoint, 0, with_topic=self.with_topic)
                    self._extend([b for b in missed if b.seq < batch.seq], got)
                self._extend([batch], got)
        return got

    def _extend(self, batches: list[Batch], got: list[Batch]) -> None:
        """Append in sequence order, skipping a batch already held (replayed, then delivered live)."""
        for batch in batches:
            if not self.batches or batch.seq > self.batches[-1].seq:
                self.batches.append(batch)
                got.append(batch)

    async def quiet(self, timeout_s: float = 0.2) -> bool:
        """True when nothing arrives within `timeout_s` (for a silent or dropping publisher)."""
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    batch = await self._inbox.get()
                    if not self.batches or batch.seq > self.batches[-1].seq:
                        break  # not one already held (replayed, then delivered live)
        except TimeoutError:
            return True
        self._inbox.put_nowait(batch)
        return False


async def replay(endpoint: str, start_seq: int, *, with_topic: bool, timeout_s: float = 5.0) -> list[Batch]:
    """Ask a publisher's ROUTER replay socket for every buffered batch from `start_seq`."""
    zctx = zmq.asyncio.Context()
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    out: list[Batch] = []
    try:
        await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        async with asyncio.timeout(timeout_s):
            while True:
                frames = await dealer.recv_multipart()
                assert frames[0] == b""
                topic, seq, payload = frames[1:] if with_topic else [b"", *frames[1:]]
                if int.from_bytes(seq, "big", signed=True) == END_SEQ:
                    return out
                out.append(decode_batch(topic, seq, payload))
    finally:
        dealer.close(linger=0)
        zctx.term()
