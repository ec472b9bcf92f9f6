"""A two-way RPC channel over one stream: the supervisor and each worker talk through it.

Why not HTTP on a second socket: the rate limiter asks the supervisor once per request that has a
limit, so a call must cost one small write and one small read, with no connection set-up, no
headers and no parser; and one connection per worker that both sides use means the supervisor
knows a worker is gone the moment its end closes (and a worker knows its supervisor is).

Frames are a 4-byte big-endian length and an orjson array `[kind, id, method, body]`: kind 0 a
request, 1 its answer, 2 its failure (body: the message), 3 a notification (no answer). A handler
returns its answer or an awaitable of it; plain functions answer within the read loop, so the
limiter's round trip takes no task. Calls in flight when the channel closes fail with
`ChannelClosed`; a handler that raises fails the call with `RemoteError` at the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import struct
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

log = logging.getLogger(__name__)

REQUEST, REPLY, FAILURE, NOTIFY = 0, 1, 2, 3
MAX_FRAME = 256 * 1024 * 1024  # a whole-hour window export of a busy worker is a few MB
_HEADER = struct.Struct(">I")

Handler = Callable[[Any], Any]


class ChannelClosed(ConnectionError):
    """The other end is gone (or the channel was closed here)."""


class RemoteError(Exception):
    """The other end's handler failed; the message is its."""


class Channel:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handlers: Mapping[str, Handler], *,
        name: str = "channel",
    ) -> None:
        self.name = name
        self._reader = reader
        self._writer = writer
        self._handlers = dict(handlers)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = asyncio.Event()

    def handle(self, method: str, handler: Handler) -> None:
        self._handlers[method] = handler

    def _send(self, frame: list[Any]) -> None:
        if self.closed.is_set():
            raise ChannelClosed(f"{self.name} is closed")
        data = orjson.dumps(frame)
        self._writer.write(_HEADER.pack(len(data)) + data)

    async def call(self, method: str, body: Any = None, *, timeout_s: float = 10.0) -> Any:
        """Ask the other end; its handler's answer (RemoteError if it failed, ChannelClosed if the
        channel closed first, TimeoutError after `timeout_s`)."""
        self._next += 1
        call_id = self._next
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self._send([REQUEST, call_id, method, body])
            async with asyncio.timeout(timeout_s):
                return await future
        finally:
            self._pending.pop(call_id, None)

    def notify(self, method: str, body: Any = None) -> None:
        """Tell the other end without waiting for anything (dropped if the channel is closed)."""
        with contextlib.suppress(ChannelClosed):
            self._send([NOTIFY, 0, method, body])

    async def run(self) -> None:
        """Read and dispatch frames until the other end closes; then fail what is still pending."""
        try:
            while True:
                header = await self._reader.readexactly(_HEADER.size)
                (size,) = _HEADER.unpack(header)
                if size > MAX_FRAME:
                    raise ValueError(f"frame of {size} bytes")
                kind, call_id, method, body = orjson.loads(await self._reader.readexactly(size))
                if kind in (REQUEST, NOTIFY):
                    self._dispatch(kind, call_id, method, body)
                else:
                    future = self._pending.get(call_id)
                    if future is not None and not future.done():
                        if kind == REPLY:
                            future.set_result(body)
                        else:
                            future.set_exception(RemoteError(str(body)))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, orjson.JSONDecodeError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError | ConnectionResetError):
                log.warning("%s: closing on a bad frame: %s", self.name, exc)
        finally:
            self._close_now()

    def _dispatch(self, kind: int, call_id: int, method: str, body: Any) -> None:
        handler = self._handlers.get(method)
        if handler is None:
            if kind == REQUEST:
                self._answer(call_id, FAILURE, f"unknown method {method!r}")
            return
        try:
            result = handler(body)
        except Exception as exc:
            self._failed(kind, call_id, method, exc)
            return
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(self._finish(kind, call_id, method, result))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif kind == REQUEST:
            self._answer(call_id, REPLY, result)

    async def _finish(self, kind: int, call_id: int, method: str, result: Awaitable[Any]) -> None:
        try:
            value = await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(kind, call_id, method, exc)
            return
        if kind == REQUEST:
            self._answer(call_id, REPLY, value)

    def _failed(self, kind: int, call_id: int, method: str, exc: Exception) -> None:
        """A handler raised: a request is answered with the error, a notification's is logged
        (called from inside the `except`, so the log carries the traceback)."""
        if kind == REQUEST:
            self._answer(call_id, FAILURE, f"{type(exc).__name__}: {exc}")
        else:
            log.exception("%s: notification %s failed", self.name, method)

    def _answer(self, call_id: int, kind: int, body: Any) -> None:
        with contextlib.suppress(ChannelClosed, ConnectionError, RuntimeError):
            self._send([kind, call_id, "", body])

    def _close_now(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed(f"{self.name} closed"))
        self._pending.clear()
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            self._writer.close()

    async def close(self) -> None:
        self._close_now()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
