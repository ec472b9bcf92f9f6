"""Hearing a vLLM or SGLang engine's KV events (I/O): its ZMQ publisher and its replay socket.

One SUB socket per backend, subscribed to the backend's topic and bound or connected to its
endpoint (one per data-parallel rank: port + rank). It is read from the moment it exists: a SUB
socket only sends its subscription once it has processed the connection, so an idle one would make
a connecting publisher drop its first batches. A socket monitor says whether a publisher is
connected (`BackendCache.connected`: what a silent source's hint is built on).

A batch after a gap or a late start, or after a restart whose first batches were missed, asks the
engine's replay ROUTER (when configured) for what is missing: vLLM answers `[topic, seq, payload]`
per batch (`[seq, payload]` before it sent the topic), SGLang `[seq, payload]`, both end with seq -1.
A replay that shows the engine restarted meanwhile is followed by one from 0 (`cache.Filled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from ..settings import KvEvents
from .cache import BackendCache, Filled
from .events import Batch, KvDecodeError, decode_frames, decode_payload, decode_seq

log = logging.getLogger(__name__)

END_SEQ = -1
REPLAY_TIMEOUT_S = 5.0
_PEER_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel `rank`: the port plus the rank (vLLM's `offset_endpoint_port`),
    or `_dp<rank>` appended to ipc/inproc names."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port) != 0:
            return f"{head}:{int(port) + rank}"
        return endpoint
    return f"{endpoint}_dp{rank}"


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start_seq: int, *,
                 timeout_s: float = REPLAY_TIMEOUT_S) -> list[Batch]:
    """Every batch the publisher still buffers from `start_seq` on (raises TimeoutError)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    out: list[Batch] = []
    try:
        await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        async with asyncio.timeout(timeout_s):
            while True:
                frames = await dealer.recv_multipart()
                if len(frames) == 4:  # vLLM: ["", topic, seq, payload]
                    seq_frame, payload = frames[2], frames[3]
                elif len(frames) == 3:  # SGLang (and vLLM before the topic frame): ["", seq, payload]
                    seq_frame, payload = frames[1], frames[2]
                else:
                    raise KvDecodeError(f"replay answer of {len(frames)} frames")
                seq = decode_seq(seq_frame)
                if seq == END_SEQ:
                    return out
                out.append(decode_payload(seq, payload))
    finally:
        dealer.close(linger=0)


class ZmqIntake:
    """One vLLM/SGLang backend's SUB socket and its receive loop."""

    def __init__(self, cfg: KvEvents, cache: BackendCache, ctx: zmq.asyncio.Context,
                 clock: Callable[[], float], *, relayed: str | None = None) -> None:
        """With `relayed`, connect to that endpoint (the supervisor's relay of every rank's
        messages, `kvcache.relay`) instead of the engine's; whether the engine is connected to
        the relay is then not known here."""
        assert cfg.endpoint is not None
        self.cfg = cfg
        self.cache = cache
        self._ctx = ctx
        self._clock = clock
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
        self._monitor: zmq.asyncio.Socket | None = None
        cache.connected = None
        if relayed is not None:
            self.endpoints = [relayed]
        else:
            self.endpoints = [rank_endpoint(cfg.endpoint, r) for r in range(cfg.data_parallel_size)]
            self._monitor = self.sock.get_monitor_socket(_PEER_EVENTS)  # before any peer can come
            cache.connected = False
        try:
            for ep in self.endpoints:
                if cfg.bind and relayed is None:
                    self.sock.bind(ep)
                else:
                    self.sock.connect(ep)
        except zmq.ZMQError:
            self.close()  # an open socket would block the context's termination
            raise

    async def run(self) -> None:
        watch = None
        if self._monitor is not None:
            watch = asyncio.get_running_loop().create_task(self._watch(self._monitor), name="kv-events-peers")
        try:
            await self._receive()
        finally:
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch

    async def _receive(self) -> None:
        cache = self.cache
        while True:
            frames = await self.sock.recv_multipart()
            try:
                batch = decode_frames(frames)
            except KvDecodeError as exc:
                cache.stats.decode_errors += 1
                log.debug("backend %s: undecodable KV event message: %s", cache.name, exc)
                continue
            start = cache.receive(batch, self._clock())
            if start is not None:
                await self._resolve(batch.rank, start)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Publishers connected (a completed handshake) minus those gone, into `cache.connected`."""
        peers = 0
        while True:
            event = (await recv_monitor_message(monitor))["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                peers += 1
            elif event == zmq.EVENT_DISCONNECTED:
                peers = max(peers - 1, 0)
            self.cache.connected = peers > 0

    async def _resolve(self, rank: int, start: int) -> None:
        """Fill what the held batch of `rank` waits for from the replay socket, or let it rebuild."""
        cache = self.cache
        if self.cfg.replay_endpoint is None:
            cache.unfilled(rank, self._clock())
            return
        endpoint = rank_endpoint(self.cfg.replay_endpoint, rank)
        while True:
            try:
                batches = await replay(self._ctx, endpoint, start)
            except (TimeoutError, KvDecodeError, zmq.ZMQError) as exc:
                log.info("backend %s: KV event replay from seq %d failed (%s)", cache.name, start, exc)
                cache.unfilled(rank, self._clock())
                return
            ours = [b for b in batches if b.rank == rank or self.cfg.data_parallel_size == 1]
            filled = cache.fill(rank, ours, self._clock())
            if filled is Filled.LOST:
                log.info("backend %s: the KV event replay from seq %d could not fill what was missed (%s)",
                         cache.name, start, cache.reason)
            if filled is not Filled.RESTARTED:
                return
            log.info("backend %s: the KV event replay shows that the engine restarted; replaying its new "
                     "sequence from 0", cache.name)
            start = 0

    def close(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self._monitor.close(linger=0)
        self.sock.close(linger=0)
