"""The native HTTP/1.1 front: the generation endpoints without aiohttp's server on the hot path.

Every connection starts here. The first bytes of each request decide who serves it: a `POST` to
one of `HOT_PATHS` (chat, completions, Responses, embeddings) is parsed with httptools and handed to the
same guard and proxy that aiohttp's handlers use; anything else (admin, metrics, dashboard, models,
health) hands the whole connection to aiohttp, which then owns it until it closes. aiohttp costs
~100 µs of CPU per request here; this front costs a few, and that is the difference between a
Python gateway and one in the Rust routers' class.

What aiohttp did for the hot path is done here too: a header timeout (slowloris, 408), a body timeout
(408), body and header size limits (413, 431), `Expect: 100-continue`, keep-alive with an idle
timeout, pipelined requests answered in order, OpenAI-shaped errors for unparseable input (400),
flow control towards slow readers, and cancellation of the request's task when its client goes away
(which aborts the upstream request). Shutdown stops accepting, closes idle connections and lets
running requests finish for up to the drain timeout.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import cast

import httptools

from backends.base import Endpoint

from ..errors import BodyTooLarge, GatewayError, InvalidRequest, RequestTimeout
from ..proxy.exchange import request_id as choose_request_id
from ..proxy.sink import Entry
from ..settings import Limits

log = logging.getLogger(__name__)

HOT_PATHS = {
    b"/v1/chat/completions": Endpoint.CHAT, b"/v1/completions": Endpoint.COMPLETIONS,
    b"/v1/responses": Endpoint.RESPONSES, b"/v1/embeddings": Endpoint.EMBEDDINGS,
}
_HOT_STARTS = tuple(b"POST " + path + b" " for path in HOT_PATHS)
_MAX_HEADERS = 256
_HIGH_WATER = 256 * 1024  # buffered request bytes (pipelining) before reading pauses



@functools.cache
def status_line(status: int) -> str:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n"


def error_bytes(error: GatewayError, request_id: str | None = None, *, close: bool = True) -> bytes:
    """A complete OpenAI-shaped error response."""
    body = error.render()
    head = [status_line(error.status), "Content-Type: application/json\r\n", f"Content-Length: {len(body)}\r\n"]
    head.extend(f"{k}: {v}\r\n" for k, v in error.headers.items())
    if request_id:
        head.append(f"x-request-id: {request_id}\r\n")
    head.append("Connection: close\r\n\r\n" if close else "\r\n")
    return "".join(head).encode("latin-1") + body


class NativeSink:
    """Where one request's response goes: all at once (`send`) or as a chunked stream."""

    __slots__ = ("_chunked", "_conn", "_keep_alive", "started")

    def __init__(self, conn: FrontProtocol, *, keep_alive: bool, http11: bool) -> None:
        self._conn = conn
        self._keep_alive = keep_alive
        self._chunked = http11
        self.started = False

    def _head(self, status: int, headers: Mapping[str, str], framing: str) -> bytes:
        lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        end = "\r\n" if self._keep_alive else "Connection: close\r\n\r\n"
        return f"{status_line(status)}{lines}{framing}{end}".encode("latin-1")

    def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """The whole response at once; a client that has gone simply does not get it."""
        self.started = True
        if self._conn.transport is None:
            return
        self._conn.write(self._head(status, headers, f"Content-Length: {len(body)}\r\n") + body)
        self._conn.response_done(self._keep_alive)

    async def start(self, status: int, headers: Mapping[str, str], first: bytes = b"") -> None:
        """The head of a streamed response, sent together with its first bytes (one packet)."""
        self.started = True
        if not self._chunked:  # HTTP/1.0: the end of the stream is the end of the connection
            self._keep_alive = False
        head = self._head(status, headers, "Transfer-Encoding: chunked\r\n" if self._chunked else "")
        self._conn.write(head + self._frame(first) if first else head)
        await self._conn.drain()

    def _frame(self, data: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data

    async def write(self, data: bytes) -> None:
        """Raises ConnectionResetError once the client has gone."""
        self._conn.write(self._frame(data))
        await self._conn.drain()

    async def end(self) -> None:
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
        self._conn.response_done(self._keep_alive)

    def fail(self, error: GatewayError, request_id: str | None) -> None:
        """An error response if nothing was sent yet, else cut the connection (the only honest signal)."""
        if self.started:
            self._conn.abort()
            return
        self.started = True
        if self._conn.transport is None:
            return
        keep = self._keep_alive and error.status not in (408, 413)
        self._conn.write(error_bytes(error, request_id, close=not keep))
        self._conn.response_done(keep)


@dataclass(slots=True)
class _Message:
    endpoint: Endpoint | None = None
    url: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    body: list[bytes] = field(default_factory=list)
    body_bytes: int = 0
    keep_alive: bool = True
    http11: bool = True
    header_bytes: int = 0
    error: GatewayError | None = None


class _Stop(Exception):
    """Raised from a parser callback to stop parsing after an error response was decided."""


class Front:
    """The protocol factory and registry of native connections (for drain and the idle sweep)."""

    def __init__(
        self, entry: Entry, fallback: Callable[[], asyncio.Protocol], limits: Callable[[], Limits],
        *, keepalive_s: float = 75.0,
    ) -> None:
        self.entry = entry  # where generation requests go, and where refusals are counted
        self.fallback = fallback  # aiohttp's protocol factory, for connections that are not ours
        self.limits = limits  # live: follows config reloads
        self.keepalive_s = keepalive_s
        self.connections: set[FrontProtocol] = set()
        # create it in the loop that serves it; Python 3.11's get_running_loop() costs a getpid()
        # syscall, so the per-request code uses this instead
        self.loop = asyncio.get_running_loop()
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False

    def __call__(self) -> FrontProtocol:
        if self._sweeper is None:
            self._sweeper = self.loop.create_task(self._sweep())
        return FrontProtocol(self)

    async def _sweep(self) -> None:
        """Close keep-alive connections idle for longer than `keepalive_s` (coarse, once a second)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(1.0)
            limit = loop.time() - self.keepalive_s
            for conn in [c for c in self.connections if c.idle_since is not None and c.idle_since < limit]:
                conn.abort()

    async def shutdown(self, timeout_s: float) -> None:
        """Close idle connections, let running requests finish for up to `timeout_s`, then cut the rest."""
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            for conn in list(self.connections):
                if conn.idle_since is not None or conn.transport is None:
                    conn.abort()
            busy = [c for c in self.connections if c.task is not None]
            if not busy or loop.time() >= deadline:
                break
            await asyncio.wait([c.task for c in busy if c.task is not None], timeout=deadline - loop.time())
        for conn in list(self.connections):
            conn.abort()

    @property
    def closing(self) -> bool:
        return self._closing


class FrontProtocol(asyncio.Protocol):
    """One client connection while it speaks to the native front."""

    def __init__(self, front: Front) -> None:
        self._front = front
        self._loop = front.loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._limits = front.limits()
        self._buf = b""  # bytes not yet given to the parser (before a request starts, or while busy)
        self._msg: _Message | None = None  # the request being parsed
        self._queue: deque[_Message] = deque()  # parsed, waiting for their turn (pipelining)
        self.task: asyncio.Task[None] | None = None
        self.idle_since: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused_reading = False
        self._drain: asyncio.Future[None] | None = None
        self._closed = False

    # -- transport events ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self._front.connections.add(self)
        self.idle_since = self._loop.time()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._closed = True
        self._front.connections.discard(self)
        self._disarm()
        if self.task is not None:
            self.task.cancel()  # the client is gone: stop its request, which aborts the upstream one
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)  # the writer wakes up and finds the connection closed
        self.transport = None

    def pause_writing(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.idle_since = None
        if self._msg is not None:  # inside a request: the parser takes everything
            self._feed(data)
        elif self.task is not None or self._queue:  # busy with earlier requests: keep it for later
            self._buf += data
            if len(self._buf) > _HIGH_WATER and self.transport is not None and not self._paused_reading:
                self._paused_reading = True
                self.transport.pause_reading()
        else:
            self._begin(self._buf + data if self._buf else data)

    def eof_received(self) -> bool | None:
        return None  # close our side too; a running request is cancelled in connection_lost

    # -- parsing ------------------------------------------------------------------------------

    def _begin(self, data: bytes) -> None:
        """A new request starts with `data`: ours if it is a generation POST, else aiohttp's."""
        self._buf = b""
        if data.startswith(_HOT_STARTS):
            self._feed(data)
        elif any(start.startswith(data) for start in _HOT_STARTS):  # too short to tell yet
            self._buf = data
            self._arm(self._limits.header_timeout_s, "The request headers were not received in time.")
        else:
            self._handoff(data)

    def _handoff(self, data: bytes) -> None:
        transport = self.transport
        if transport is None:
            return
        self._disarm()
        self._front.connections.discard(self)
        protocol = self._front.fallback()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(data)
        self.transport = None

    def _feed(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # a callback decided: the error is on the message
        except httptools.HttpParserError as exc:
            self._reject(InvalidRequest(f"Invalid HTTP request: {exc}"))
            return
        msg = self._msg
        if msg is not None:
            if msg.error is not None:
                self._reject(msg.error)
            elif self._timer is None:  # incomplete: headers or body are still coming
                if msg.endpoint is None:
                    self._arm(self._limits.header_timeout_s, "The request headers were not received in time.")
                else:
                    self._arm(self._limits.body_timeout_s, "The request body was not received in time.")
        self._next()

    def on_message_begin(self) -> None:
        self._msg = _Message()

    def on_url(self, url: bytes) -> None:
        msg = self._msg
        assert msg is not None
        msg.url += url
        msg.header_bytes += len(url)
        if msg.header_bytes > self._limits.max_header_bytes:
            self._stop(GatewayError("Request header fields too large: the request line is too long."), 431)

    def on_header(self, name: bytes, value: bytes) -> None:
        msg = self._msg
        assert msg is not None
        if len(name) + len(value) > self._limits.max_header_bytes or len(msg.headers) >= _MAX_HEADERS:
            self._stop(GatewayError("Request header fields too large."), 431)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        msg.headers[key] = msg.headers[key] + ", " + text if key in msg.headers else text

    def on_headers_complete(self) -> None:
        msg = self._msg
        assert msg is not None
        self._disarm()
        parser = self._parser
        endpoint = HOT_PATHS.get(msg.url)
        msg.keep_alive = parser.should_keep_alive()
        msg.http11 = parser.get_http_version() == "1.1"
        if endpoint is None or parser.get_method() != b"POST":
            self._stop(InvalidRequest("Pipelined requests are only accepted for the generation endpoints."), 400)
        msg.endpoint = endpoint
        length = msg.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._limits.max_body_bytes:
            self._stop(BodyTooLarge(f"Request body too large: {length} bytes, the limit is "
                                    f"{self._limits.max_body_bytes}."), 413)
        if msg.headers.get("expect", "").lower() == "100-continue":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        msg = self._msg
        assert msg is not None
        msg.body.append(body)
        msg.body_bytes += len(body)
        if msg.body_bytes > self._limits.max_body_bytes:
            self._stop(BodyTooLarge(f"Request body too large: the limit is {self._limits.max_body_bytes} bytes."), 413)

    def on_message_complete(self) -> None:
        msg = self._msg
        assert msg is not None
        self._disarm()
        self._msg = None
        self._queue.append(msg)

    def _stop(self, error: GatewayError, status: int) -> None:
        assert self._msg is not None
        error.status = status
        self._msg.error = error
        raise _Stop

    # -- running requests, one at a time per connection ---------------------------------------

    def _next(self) -> None:
        if self.task is not None or not self._queue or self._closed:
            return
        msg = self._queue.popleft()
        self.task = self._loop.create_task(self._run(msg))

    async def _run(self, msg: _Message) -> None:
        reply = NativeSink(self, keep_alive=msg.keep_alive and not self._front.closing, http11=msg.http11)
        request_id = choose_request_id(msg.headers.get("x-request-id"))
        assert msg.endpoint is not None
        body = msg.body[0] if len(msg.body) == 1 else b"".join(msg.body)
        try:
            await self._front.entry.dispatch(msg.headers, body, msg.endpoint, reply, request_id)
            if not reply.started:  # a dispatcher that wrote nothing: never leave a client hanging
                raise GatewayError("The gateway produced no response.")
        except GatewayError as exc:
            reply.fail(exc, request_id)
        except UnicodeDecodeError:
            reply.fail(InvalidRequest("Request body is not valid UTF-8."), request_id)
        except (asyncio.CancelledError, ConnectionError):
            self.abort()  # the client went away
        except Exception:
            log.exception("request %s failed", request_id)
            error = GatewayError("The gateway failed to handle the request.")
            error.status, error.type = 500, "server_error"
            reply.fail(error, request_id)
        finally:
            self.task = None
        self._resume()

    def response_done(self, keep_alive: bool) -> None:
        """A response was written completely: close, or go on reading what the client sends next."""
        if not keep_alive:
            self.abort(graceful=True)
        elif self._paused_reading and self.transport is not None:
            self._paused_reading = False
            self.transport.resume_reading()

    def _resume(self) -> None:
        """The running request finished: start the next one, or wait for one."""
        if self._closed or self.task is not None:
            return
        if self._queue:
            self._next()
        elif self._buf and self._msg is None:
            self._begin(self._buf)
        elif self._msg is None:
            self.idle_since = self._loop.time()

    # -- writing and closing ------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.transport is None or self._closed:
            raise ConnectionResetError("client closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionResetError("client closed the connection")
        if self._drain is not None and not self._drain.done():
            await self._drain
            if self._closed:
                raise ConnectionResetError("client closed the connection")

    def _reject(self, error: GatewayError) -> None:
        """Answer a request the parser or a limit refused, then close: the rest is not worth reading."""
        self._msg = None
        self._queue.clear()
        if self.task is not None:  # an earlier pipelined response is still being written: just cut
            self.abort()
            return
        self._disarm()
        if self.transport is not None and not self._closed:
            self.transport.write(error_bytes(error))
        self.abort(graceful=True)

    def _arm(self, after_s: float, message: str) -> None:
        self._disarm()
        self._timer = self._loop.call_later(after_s, self._timed_out, message)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self, message: str) -> None:
        self._timer = None
        if self.task is None:
            self._reject(RequestTimeout(message))

    def abort(self, *, graceful: bool = False) -> None:
        """Close the connection: `graceful` after what was written is sent, else at once."""
        self._closed = True
        self._front.connections.discard(self)
        self._disarm()
        if self.transport is not None:
            if graceful:
                self.transport.close()
            else:
                self.transport.abort()

