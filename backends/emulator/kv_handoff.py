"""A prefill server's KV kept for its decode, and the side channel a decode pulls it through (I/O).

vLLM's NixlConnector (`nixl_connector.py`): a finished prefill-only request (`do_remote_decode`,
capped by `max_tokens`) keeps its blocks (`request_finished` returns `delay_free_blocks`) until a
decode has read them, or for `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` seconds (480 by default; then "Releasing
expired KV blocks"); the decode handshakes with the prefill's side channel, a ZMQ ROUTER on
`VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT + dp_rank` answering `(GET_META_MSG, tp_rank)`
with the agent metadata (its `engine_id` must be the params' `remote_engine_id`), then reads the
blocks with NIXL and notifies the prefill, which frees them. trtllm-serve's context server keeps a
context-only request's KV for its generation server likewise (`kv_transfer_timeout_ms`).

The emulator's side channel is a real ZMQ ROUTER on that port, speaking msgpack: `["get_meta_msg",
tp_rank]` answers `{"engine_id", "block_size", "num_blocks"}`; `["read", request_id, block_ids]`
stands for the NIXL read plus its notification: it answers the prompt token ids the blocks hold
(`{"ok": true, "tokens": [...]}`) and frees them, or `{"ok": false, "error": ...}` for a request it
does not hold (never kept, already read, expired) or other block ids. The decode compares the
tokens with its own prompt: only a common prefix is "loaded".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import zmq
import zmq.asyncio

from backends.emulator.config import EmulatorStats
from backends.emulator.engine import Engine

log = logging.getLogger(__name__)
GET_META_MSG = "get_meta_msg"
READ_MSG = "read"
PULL_TIMEOUT_S = 5.0  # wall seconds a decode waits for the side channel before it gives up


@dataclass(slots=True)
class Lease:
    """One finished prefill's KV, kept for its decode."""

    request_id: str
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]
    expires: asyncio.TimerHandle | None = None


class KvHandoff:
    """One engine's (one DP rank's) kept KV and its side channel (`bind` starts the ROUTER)."""

    def __init__(
        self, engine: Engine, *, engine_id: str, lease_s: float, stats: EmulatorStats,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.engine_id = engine_id
        self.lease_s = lease_s
        self.stats = stats
        self._on_change = on_change  # the engine driver's `refresh`: KV usage changed outside a step
        self.leases: dict[str, Lease] = {}
        self._next_block = 0
        self._zctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.host = ""
        self.port = 0

    # --- the kept KV (pure bookkeeping over the engine's block count) ------------------------
    def keep(self, request_id: str, tokens: Sequence[int]) -> list[int]:
        """Hold a finished prefill's blocks for `lease_s` wall seconds; returns their block ids."""
        blocks = self.engine.blocks_for(len(tokens))
        ids = tuple(range(self._next_block, self._next_block + blocks))
        self._next_block += blocks
        self.engine.hold_blocks(blocks)
        if self._on_change is not None:
            self._on_change()
        lease = Lease(request_id, tuple(tokens), ids)
        self.leases[request_id] = lease
        with contextlib.suppress(RuntimeError):  # no running loop: a pure test
            lease.expires = asyncio.get_running_loop().call_later(self.lease_s, self._expire, request_id)
        self.stats.kv_produced += 1
        return list(ids)

    def take(self, request_id: str, block_ids: Sequence[int] | None) -> tuple[int, ...] | str:
        """A decode's read of a lease: the prompt its blocks hold (then freed), or why not
        (`block_ids` None: the reader names the request only, as trtllm's opaque state does)."""
        lease = self.leases.get(request_id)
        if lease is None:
            return f"request {request_id} holds no KV blocks on engine {self.engine_id} (never kept, read or expired)"
        if block_ids is not None and tuple(block_ids) != lease.block_ids:
            return f"request {request_id}: block ids {list(block_ids)[:4]}... are not the kept blocks"
        self._release(lease)
        return lease.tokens

    def _release(self, lease: Lease) -> None:
        self.leases.pop(lease.request_id, None)
        if lease.expires is not None:
            lease.expires.cancel()
        self.engine.release_blocks(len(lease.block_ids))
        if self._on_change is not None:
            self._on_change()

    def _expire(self, request_id: str) -> None:
        lease = self.leases.get(request_id)
        if lease is None:
            return
        log.warning("Releasing expired KV blocks for request %s which were retrieved by 0 decode worker(s) "
                    "within %s seconds.", request_id, self.lease_s)
        self.stats.kv_expired += 1
        self._release(lease)

    # --- the side channel --------------------------------------------------------------------
    def bind(self, zctx: zmq.asyncio.Context, host: str, port: int) -> None:
        """Bind the ROUTER (`port` 0: a free port) and serve it until `close()`."""
        sock = zctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{host}"
        self.port = sock.bind_to_random_port(address) if port == 0 else port
        if port:
            sock.bind(f"{address}:{port}")
        self.host = host
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._serve(sock), name="emulator-kv-side-channel")

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            identity, _, raw = await sock.recv_multipart()
            await sock.send_multipart([identity, b"", msgpack.packb(self.answer(raw))])

    def answer(self, raw: bytes) -> object:
        try:
            msg = msgpack.unpackb(raw)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return {"ok": False, "error": "undecodable message"}
        if isinstance(msg, list) and msg and msg[0] == GET_META_MSG:
            return {"engine_id": self.engine_id, "block_size": self.engine.params.block_size,
                    "num_blocks": self.engine.params.kv_blocks}
        if isinstance(msg, list) and len(msg) == 3 and msg[0] == READ_MSG:
            got = self.take(str(msg[1]), None if msg[2] is None else [int(b) for b in msg[2]])
            if isinstance(got, str):
                return {"ok": False, "error": got}
            return {"ok": True, "tokens": list(got)}
        return {"ok": False, "error": f"unexpected message {msg!r:.80}"}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close(0)
        for lease in list(self.leases.values()):
            if lease.expires is not None:
                lease.expires.cancel()


class PullError(Exception):
    """The KV could not be loaded from the prefill server (the decode recomputes, or fails)."""


async def pull(
    zctx: zmq.asyncio.Context, *, host: str, port: int, engine_id: str, request_id: str,
    block_ids: Sequence[int] | None,
    timeout_s: float = PULL_TIMEOUT_S,
) -> tuple[int, ...]:
    """Handshake with a prefill's side channel, check its engine id, read the blocks: the prompt
    token ids they hold. Raises PullError (unreachable, wrong engine, blocks not held)."""
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        meta = await _ask(sock, [GET_META_MSG, 0], timeout_s)
        if not isinstance(meta, dict) or meta.get("engine_id") != engine_id:
            got = meta.get("engine_id") if isinstance(meta, dict) else meta
            raise PullError(f"Remote NIXL agent engine ID mismatch. Expected {engine_id}, received {got}.")
        reply = await _ask(sock, [READ_MSG, request_id, None if block_ids is None else list(block_ids)], timeout_s)
        if not isinstance(reply, dict) or not reply.get("ok"):
            raise PullError(str(reply.get("error") if isinstance(reply, dict) else reply))
        return tuple(int(t) for t in reply["tokens"])
    finally:
        sock.close(0)


async def _ask(sock: zmq.asyncio.Socket, msg: object, timeout_s: float) -> object:
    await sock.send_multipart([b"", msgpack.packb(msg)])
    try:
        async with asyncio.timeout(timeout_s):
            frames = await sock.recv_multipart()
    except TimeoutError:
        raise PullError(f"no answer from the side channel within {timeout_s} s") from None
    return msgpack.unpackb(frames[-1])


def common_prefix(a: Sequence[int], b: Sequence[int], granularity: int) -> int:
    """Leading tokens `a` and `b` share, rounded down to whole blocks of `granularity`."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n // granularity * granularity if granularity > 1 else n
