"""One SGLang rank's KV manager for P/D: the ZMQ PULL socket its peers push to (I/O).

In SGLang (`CommonKVManager`, `srt/disaggregation/common/conn.py`) every prefill and decode rank
binds a PULL socket (`rank_port`); a prefill rank registers it with its bootstrap server, a decode
finds it there, pushes its destination for a room to it, and the prefill pushes the transfer's
status back to the decode's socket; a decode that gives up pushes `ABORT`. The emulator keeps that
shape with ASCII frames: `[b"ROOM", room, host, port, decode_prefix_len]` (decode -> prefill: "I am
ready for this room"), `[b"DONE", room, tokens]` / `[b"FAIL", room, reason]` (prefill -> decode),
`[b"ABORT", room, host, port]` (decode -> prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import zmq
import zmq.asyncio


@dataclass(frozen=True, slots=True)
class Registration:
    """A decode waiting for a room's KV: where to push its status, and what it already has cached."""

    host: str
    port: int
    prefix_len: int


class KvManager:
    def __init__(self, zctx: zmq.asyncio.Context, host: str, rank: int) -> None:
        self.rank = rank
        self.host = host
        self._zctx = zctx
        self._sock = zctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self.registrations: dict[int, Registration] = {}  # prefill: decodes that arrived for a room
        self._registered: dict[int, asyncio.Future[Registration]] = {}
        self._kv: dict[int, asyncio.Future[int | str]] = {}  # decode: the status of a room's transfer
        self._task = asyncio.get_running_loop().create_task(self._serve(), name=f"emulator-sglang-kv-{rank}")

    async def _serve(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            self.handle([f.decode("ascii", "replace") for f in frames])

    def handle(self, frames: list[str]) -> None:
        kind, room = frames[0], int(frames[1])
        if kind == "ROOM":
            reg = Registration(frames[2], int(frames[3]), int(frames[4]))
            waiter = self._registered.pop(room, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(reg)
            else:
                self.registrations[room] = reg
        elif kind == "ABORT":
            self.registrations.pop(room, None)
        elif kind in ("DONE", "FAIL"):
            fut = self._kv.get(room)
            if fut is not None and not fut.done():
                fut.set_result(int(frames[2]) if kind == "DONE" else frames[2])

    # --- prefill side ---------------------------------------------------------------------------
    async def decode_for(self, room: int, timeout_s: float) -> Registration:
        """The decode that registered `room` (waiting for it up to `timeout_s`; TimeoutError)."""
        reg = self.registrations.pop(room, None)
        if reg is not None:
            return reg
        waiter: asyncio.Future[Registration] = asyncio.get_running_loop().create_future()
        self._registered[room] = waiter
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._registered.pop(room, None)

    # --- decode side ----------------------------------------------------------------------------
    def expect_kv(self, room: int) -> asyncio.Future[int | str]:
        fut: asyncio.Future[int | str] = asyncio.get_running_loop().create_future()
        self._kv[room] = fut
        return fut

    def forget(self, room: int) -> None:
        self._kv.pop(room, None)

    async def push(self, host: str, port: int, *frames: object) -> None:
        endpoint = f"tcp://{host}:{port}"
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self._zctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        await sock.send_multipart([str(f).encode("ascii") for f in frames])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for sock in self._push.values():
            sock.close(0)
        self._sock.close(0)
