"""The ZMQ KV-event publisher of the vLLM and SGLang faces (I/O).

As `ZmqEventPublisher` in vLLM 0.32 (`vllm/distributed/kv_events.py`) and SGLang
(`srt/disaggregation/kv_events.py`): a PUB socket that binds when the endpoint is a wildcard
(`*`, `::`) or `ipc://`/`inproc://`, and otherwise *connects* (the subscriber binds); high-water
mark 100,000; every batch goes out as three frames `[topic, seq as 8-byte big-endian, msgpack
payload]` with `seq` counting from 0 per process, so a restart starts again at 0. The optional
replay socket is a ROUTER: a request `[identity, b"", start_seq (8 bytes)]` gets every buffered
batch from `start_seq` and an end marker with seq -1 (vLLM 0.32 replies `[topic, seq, payload]`;
SGLang `[seq, payload]`).

The socket is an XPUB, wire-identical to the engines' PUB (a subscriber cannot tell them apart,
and batches published before a subscription arrives are dropped just the same), so that the
emulator can say when a subscription took effect (`subscriptions`): a test that wants
the engine's first batch waits for it, as a deployment cannot (the gateway then joins late).

Test knobs (`KvEventsConfig` and the methods below): a dropped batch consumes its sequence number
and stays in the replay buffer but is never sent; a silent publisher sends nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from backends.emulator.config import KvEventsConfig
from backends.emulator.kv_events import KvEvent, encode_batch

HWM = 100_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's `_is_bind_endpoint` (SGLang: the same test): bind wildcards and ipc/inproc, connect the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKvPublisher:
    def __init__(
        self, cfg: KvEventsConfig, *, style: str, replay_with_topic: bool, clock: Callable[[], float] = time.time,
        dp_rank: int = 0,
    ) -> None:
        self.cfg = cfg
        self.dp_rank = dp_rank  # stamped in every batch (vLLM's `data_parallel_rank`, SGLang's `attn_dp_rank`)
        self.style = style
        self._replay_with_topic = replay_with_topic
        self._clock = clock
        self._topic = cfg.topic.encode()
        self._zctx = zmq.asyncio.Context()
        self._pub = self._zctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        if binds(cfg.endpoint):
            self._pub.bind(cfg.endpoint)
        else:
            self._pub.connect(cfg.endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self.subscriptions = 0  # topics subscribed to (XPUB reports the first subscribe and the last unsubscribe)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._count_subscriptions(), name="kv-subscriptions")]
        self._replay: zmq.asyncio.Socket | None = None
        if cfg.replay_endpoint is not None:
            self._replay = self._zctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(cfg.replay_endpoint)
            self._tasks.append(loop.create_task(self._serve_replay(), name="kv-replay"))
        self.seq = 0  # the next sequence number
        self.sent = 0
        self._drop = set(cfg.drop_batches)
        self._silent = False

    # --- test knobs ---------------------------------------------------------------------------
    def drop_next(self, count: int = 1) -> None:
        """The next `count` batches are consumed but not sent (the subscriber sees a gap)."""
        self._drop.update(range(self.seq, self.seq + count))

    def silence(self, silent: bool = True) -> None:
        self._silent = silent

    # --- publishing ---------------------------------------------------------------------------
    def publish(self, events: Sequence[KvEvent]) -> None:
        if not events:
            return
        seq, self.seq = self.seq, self.seq + 1
        payload = encode_batch(self.style, self._clock(), events, self.dp_rank)
        self._buffer.append((seq, payload))
        limit = self.cfg.silent_after
        if self._silent or seq in self._drop or (limit is not None and seq >= limit):
            return
        with contextlib.suppress(zmq.Again):  # past the high-water mark the batch is dropped, as in ZMQ
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        self.sent += 1

    async def _count_subscriptions(self) -> None:
        while True:
            message = await self._pub.recv()  # b"\x01" + topic subscribes, b"\x00" + topic unsubscribes
            self.subscriptions += 1 if message[:1] == b"\x01" else -1

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    head = [client, b"", self._topic] if self._replay_with_topic else [client, b""]
                    await self._replay.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end = [client, b"", b""] if self._replay_with_topic else [client, b""]
            await self._replay.send_multipart([*end, END_SEQ, b""])

    def source_config(self) -> dict[str, object]:
        """vLLM's `/kv_event_sources` entry for this publisher (its resolved KVEventsConfig)."""
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.cfg.endpoint,
                "replay_endpoint": self.cfg.replay_endpoint, "buffer_steps": self.cfg.buffer_steps, "hwm": HWM,
                "max_queue_size": 100_000, "topic": self.cfg.topic}

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._zctx.term()
