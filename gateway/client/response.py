"""One upstream response: status and headers once its head has arrived, the body as it arrives.

The connection (`connection.Connection`) fills it from its parser callbacks; the proxy reads it with
`read()`, `readany()` or `async for`, or has it handed over as it arrives with `pipe()`. Closing it
before the body's end aborts the connection.

Why `pipe`: reading a stream with `async for` costs, per read, a future resolved, a task woken and
every coroutine between the task and the read resumed (about as much as the relay's own work on a
one-token read). A pipe calls its consumer from the parser's callback instead, so a relayed stream
wakes its task only when the client is slower than the upstream, or at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final

from .errors import UpstreamClientError, UpstreamProtocolError

if TYPE_CHECKING:
    from .connection import Connection

HIGH_WATER_BYTES: Final = 256 * 1024  # buffered and unread: past this, reading from the socket pauses


class UpstreamResponse:
    """Header names are lower-cased; the body is buffered only until it is read."""

    __slots__ = ("_chunks", "_conn", "_consume", "_consume_error", "_eof", "_exc", "_full", "_headers", "_raw_headers",
                 "_size", "_waiter", "head", "keep_alive", "status")

    def __init__(self, conn: Connection, head: asyncio.Future[None]) -> None:
        self.status = 0  # 0 until the final (non-1xx) head has arrived
        self.head = head  # resolves when it has, or fails with the connection
        self.keep_alive = False
        self._raw_headers: list[tuple[bytes, bytes]] = []  # decoded only if someone asks (rarely)
        self._headers: dict[str, str] | None = None
        self._conn: Connection | None = conn  # None once the body is complete, failed or closed
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False  # nothing more will arrive
        self._exc: UpstreamClientError | None = None  # raised once the buffered bytes are read
        self._waiter: asyncio.Future[None] | None = None
        self._consume: Callable[[bytes], bool] | None = None  # a running `pipe`'s consumer
        self._consume_error: Exception | None = None  # what it raised
        self._full = False  # it returned True: the pipe awaits `flush` before it consumes more

    @property
    def headers(self) -> dict[str, str]:
        """Header names lower-cased; repeated headers joined with ", "."""
        if self._headers is None:
            headers: dict[str, str] = {}
            for name, value in self._raw_headers:
                key = name.decode("latin-1").lower()
                text = value.decode("latin-1")
                headers[key] = f"{headers[key]}, {text}" if key in headers else text
            self._headers = headers
        return self._headers

    @property
    def done(self) -> bool:
        """Nothing more to read: the body was read to its end, or the response failed or was closed."""
        return self._eof and not self._chunks

    @property
    def complete(self) -> bool:
        """The whole body has been taken (read to its end, without a failure): nothing more will come."""
        return self._eof and not self._chunks and self._exc is None

    async def readany(self) -> bytes:
        """The bytes received since the last call, as soon as there are any; b"" at the end."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            return b""

    async def read(self) -> bytes:
        """The whole remaining body."""
        if self._eof and self._exc is None:
            data = b"".join(self._chunks)
            self._chunks.clear()
            return data
        parts = []
        async for chunk in self:
            parts.append(chunk)
        return b"".join(parts)

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        """`readany`, for `async for`: the bytes received since the last call, as soon as there are
        any. The relay loop's one coroutine per read (not a second one around `readany`)."""
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                raise StopAsyncIteration
            self._waiter = self.head.get_loop().create_future()
            try:
                await self._waiter
            except BaseException:
                self.close()
                raise
            finally:
                self._waiter = None
        return self._take()

    async def pipe(self, consume: Callable[[bytes], bool], flush: Callable[[], Awaitable[None]]) -> None:
        """Hand the rest of the body to `consume` as it arrives, from the connection's callback, until
        its end. When `consume` returns True (its client is full), it gets nothing more until
        `flush()` has returned (meanwhile the body is buffered, and reading pauses past the high-water
        mark). Raises what failed the response, or what `consume` raised; either, or a cancellation,
        closes the response."""
        try:
            while True:
                if self._chunks:  # arrived before the pipe began, or while it waited for `flush`
                    if consume(self._take()):
                        await flush()
                    continue
                if self._exc is not None:
                    raise self._exc
                if self._eof:
                    return
                self._consume = consume
                self._waiter = self.head.get_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
                    self._consume = None
                error, self._consume_error = self._consume_error, None
                if error is not None:
                    raise error
                if self._full:
                    self._full = False
                    await flush()
        except BaseException:
            self.close()
            raise

    def _take(self) -> bytes:
        """Everything buffered (there is something), and reading resumed if it had paused."""
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return data

    def close(self) -> None:
        """Release the response. Before the body's end this aborts the connection."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.resp = None
            conn.close()
        if not self._eof:
            self.fail(UpstreamProtocolError("response closed before its end"))
        self._chunks.clear()

    # -- called by the connection ----------------------------------------------------------------

    def header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def interim(self) -> None:
        """A 1xx head ended: its headers are not the response's."""
        self._raw_headers = []

    def headed(self, status: int, keep_alive: bool) -> None:
        self.status = status
        self.keep_alive = keep_alive
        if not self.head.done():
            self.head.set_result(None)

    def feed(self, body: bytes) -> int:
        """Buffer body bytes, or hand them to a running pipe's consumer; returns how many are
        buffered and unread."""
        if not body:  # a reader takes b"" for the end
            return self._size
        consume = self._consume
        if consume is not None:
            try:
                if not consume(body):
                    return 0
                self._full = True
            except Exception as exc:  # never into the parser: the pipe raises it
                self._consume_error = exc
            self._consume = None
            self._wake()
            return 0
        self._chunks.append(body)
        self._size += len(body)
        self._wake()
        return self._size

    def finish(self) -> None:
        self._conn = None
        self._eof = True
        self._wake()

    def fail(self, exc: UpstreamClientError) -> None:
        self._conn = None
        self._eof = True
        self._exc = exc
        if not self.head.done():
            self.head.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
