"""The native HTTP/1.1 front: the generation endpoints without aiohttp's server on the hot path.

Every connection starts here. The first bytes of each request decide who serves it: a `POST` to
one of `HOT_PATHS` (chat, completions, Responses, embeddings) is read by `reader.Reader` (httptools) and
handed to the same `Entry` that aiohttp's handlers use; any other request hands the connection, with
the bytes it sent, to aiohttp (`aiohttp_server.GatewayProtocol`), which owns it from then on. aiohttp
costs ~100 µs of CPU per request here; this front costs a few, and that is the difference between a
Python gateway and one in the Rust routers' class.

One request at a time per connection: bytes that arrive while a request is being served wait, unread,
until its response is written; then the next request is read (and handed to aiohttp if it is not a
generation request). So pipelined requests of any kind are answered in order, and `100 Continue` is
sent when a request's turn comes, never while an earlier response is still running.

What aiohttp does is done here too: a header timeout (slowloris, 408), a body timeout (408), limits
on the request line, each header field, the whole head and the body (431, 413), unparseable
requests (400), all OpenAI-shaped and each reported to `Entry.refused` so that every generation
request is counted once; keep-alive with an idle timeout; half-closed clients (they still get
their responses); `Date` on every response; flow control towards slow readers; and cancellation of
the request's task when its client goes away (which aborts the upstream request). Shutdown stops
accepting, closes idle connections and lets running requests finish for up to the drain timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Final, cast

from backends.base import Endpoint

from ..errors import GatewayError, InvalidRequest, RequestTimeout
from ..proxy.exchange import request_id as choose_request_id
from ..proxy.sink import Entry
from ..settings import Limits
from .halfclose import PROBE, STREAM_PROBE, GoneWatch
from .reader import COMPLETE, FAILED, HEADERS, Message, Reader
from .wire import date_line, error_bytes, status_line

log = logging.getLogger(__name__)

HOT_PATHS: Final = {
    b"/v1/chat/completions": Endpoint.CHAT, b"/v1/completions": Endpoint.COMPLETIONS,
    b"/v1/responses": Endpoint.RESPONSES, b"/v1/embeddings": Endpoint.EMBEDDINGS,
}
_HOT_STARTS: Final = tuple(b"POST " + path + b" " for path in HOT_PATHS)
_HIGH_WATER: Final = 256 * 1024  # bytes buffered behind a running request before reading pauses
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_BLANK: Final = (13, 10)  # CR, LF: empty lines between requests are skipped (RFC 9112 2.2)
# a chunk's size line, looked up for the common sizes: `%x` formatting costs ~500 instructions a chunk,
# and with the size line a bytes object `%b` alone compiles to one allocation (mypyc's CPyBytes_Build)
_SIZE_LINES: Final = tuple(b"%x\r\n" % n for n in range(4096))


def _size_line(n: int) -> bytes:
    """The size line of a chunk of `n` bytes."""
    return _SIZE_LINES[n] if n < 4096 else b"%x\r\n" % n


def take_body(msg: Message) -> bytes:
    """The request's body, which `msg` stops holding: the task serving the request keeps `msg` (its
    headers) for as long as the response lasts, a stream's included, and the body only until it is
    parsed (`Dispatcher.dispatch`)."""
    parts = msg.body
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    parts.clear()
    return body


class NativeSink:
    """Where one request's response goes: all at once (`send`) or as a chunked stream."""

    __slots__ = ("_chunked", "_conn", "_keep_alive", "_streaming", "started")

    def __init__(self, conn: FrontProtocol, *, keep_alive: bool, http11: bool) -> None:
        self._conn = conn
        self._keep_alive = keep_alive
        self._chunked = http11
        self._streaming = False  # between `start` and `end`: a client may be sent a comment event
        self.started = False

    def probe(self) -> bytes:
        """What may be written now to see whether a client that sent a FIN is still there (`halfclose`):
        `100 Continue` before the response (HTTP/1.1 only), an SSE comment while a stream is open
        (between two of its events: the relay writes whole events), else nothing."""
        if not self.started:
            return PROBE if self._chunked else b""
        return self._frame(STREAM_PROBE) if self._streaming else b""

    def _head(self, status: int, headers: Mapping[str, str], framing: str) -> bytes:
        lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        if not self._keep_alive:
            end = "Connection: close\r\n\r\n"
        else:  # HTTP/1.0 closes unless the response says otherwise
            end = "\r\n" if self._chunked else "Connection: keep-alive\r\n\r\n"
        return f"{status_line(status)}{self._conn.date}{lines}{framing}{end}".encode("latin-1")

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
        self._streaming = True
        await self._conn.drain()

    async def send_stream(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """A stream whose whole body is at hand: head, events and the end in one write (one syscall
        where `start` and `end` would make two, and one wake-up of the client)."""
        self.started = True
        if not self._chunked:
            self._keep_alive = False
        head = self._head(status, headers, "Transfer-Encoding: chunked\r\n" if self._chunked else "")
        if not self._chunked:
            self._conn.write(head + body)
        elif body:  # (one join: `+` would copy the body three times)
            self._conn.write(b"".join((head, _size_line(len(body)), body, b"\r\n0\r\n\r\n")))
        else:
            self._conn.write(head + b"0\r\n\r\n")
        self._conn.response_done(self._keep_alive)

    def _frame(self, data: bytes) -> bytes:
        if not self._chunked:
            return data
        return b"%b%b\r\n" % (_size_line(len(data)), data)

    async def write(self, data: bytes) -> None:
        """Raises ConnectionResetError once the client has gone."""
        self._conn.write(self._frame(data))
        await self._conn.drain()

    def push(self, data: bytes) -> bool:
        """Raises ConnectionResetError once the client has gone; True while its socket is full."""
        self._conn.write(self._frame(data))
        return self._conn.congested

    async def flush(self) -> None:
        await self._conn.drain()

    async def end(self) -> None:
        self._streaming = False
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


class Front:
    """The protocol factory and registry of native connections (for drain and the idle sweep)."""

    def __init__(
        self, entry: Entry, fallback: Callable[[], asyncio.Protocol], limits: Limits, *, keepalive_s: float = 75.0,
    ) -> None:
        self.entry = entry  # where generation requests go, and where refusals are counted
        self.fallback = fallback  # aiohttp's protocol factory, for requests that are not ours
        self.limits = limits  # read once at start, like aiohttp's (a reload reports a change as restart_required)
        self.keepalive_s = keepalive_s
        self.connections: set[FrontProtocol] = set()
        self.date = date_line()  # every response's `Date` line, refreshed once a second by `_sweep`
        # create it in the loop that serves it; Python 3.11's get_running_loop() costs a getpid()
        # syscall, so the per-request code uses this instead
        self.loop = asyncio.get_running_loop()
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False

    def __call__(self) -> FrontProtocol:
        if self._sweeper is None:
            self.date = date_line()
            self._sweeper = self.loop.create_task(self._sweep())
        return FrontProtocol(self)

    async def _sweep(self) -> None:
        """Once a second: refresh `date`, and close keep-alive connections idle for longer than
        `keepalive_s`."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(1.0 - time.time() % 1.0)  # just after each second begins
            self.date = date_line()
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
        self._limits = front.limits
        self._reader = Reader(front.limits)
        self._buf = b""  # received bytes not read yet: the next requests, held while one is served
        self.task: asyncio.Task[None] | None = None
        self.idle_since: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused_reading = False
        self._drain: asyncio.Future[None] | None = None
        self._closed = False
        self._eof = False  # the client shut down its sending side: answer what it sent, then close
        self._reply: NativeSink | None = None  # the running request's response
        self._http11 = True  # ... and whether that request was HTTP/1.1
        self._watch: GoneWatch | None = None  # after a FIN during a request: has the client gone?
        # a request whose task was created but has not run yet: if the client goes now, the task is
        # cancelled before it ever reaches the dispatcher, so it is counted here instead
        self._starting: tuple[Endpoint, str | None] | None = None

    @property
    def date(self) -> str:
        return self._front.date

    # -- transport events ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self._front.connections.add(self)
        self.idle_since = self._loop.time()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._closed = True
        self._front.connections.discard(self)
        self._disarm()
        if self._watch is not None:
            self._watch.stop()
        if self.task is not None:
            self.task.cancel()  # the client is gone: stop its request, which aborts the upstream one
        if self._starting is not None:
            endpoint, request_id = self._starting
            self._starting = None
            self._front.entry.refused(endpoint, "client_closed", request_id)
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
        if self._closed:
            return  # closing: nothing more is read
        self.idle_since = None
        self._buf = self._buf + data if self._buf else data
        if self.task is None:
            self._read()
        elif len(self._buf) > _HIGH_WATER and self.transport is not None and not self._paused_reading:
            self._paused_reading = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        """A half-close: keep the connection to answer what was sent, then close. While a request
        runs, watch whether the client has in fact gone (`halfclose`)."""
        if self._eof:
            return True  # uvloop may report the end of the stream more than once
        self._eof = True
        if self.task is None:  # everything complete was started already: what is left never will be
            self.abort(graceful=True)
        else:
            self._watch_client()
        return True

    def _watch_client(self) -> None:
        if self.transport is not None and self._watch is None:
            reply = self._reply
            probe = reply.probe() if reply is not None else PROBE if self._http11 else b""
            self._watch = GoneWatch(self._loop, self.transport, self.abort, probe=probe)

    # -- reading requests, one at a time ------------------------------------------------------

    def _read(self) -> None:
        """Read buffered bytes while no request is being served, up to the end of the next request."""
        reader = self._reader
        buf = self._buf
        n = len(buf)
        pos = 0
        while pos < n and not self._closed:
            if reader.message is None:  # between requests: the next one is ours, or aiohttp's
                if reader.closed:  # after a request without keep-alive: the connection closes
                    pos = n
                    break
                if buf[pos] in _BLANK:
                    pos += 1
                    continue
                if not buf.startswith(_HOT_STARTS, pos):
                    rest = buf[pos:]
                    if any(start.startswith(rest) for start in _HOT_STARTS):
                        break  # too short to tell yet
                    self._buf = b""
                    self._handoff(rest)
                    return
            pos = reader.feed(buf, pos)
            event = reader.event
            if event == HEADERS:
                self._disarm()  # the header timeout is over; the body timeout starts below
                msg = reader.message
                if msg is not None and msg.expect_continue:
                    self.write(_CONTINUE)  # this request's turn has come: ask for its body
            elif event == COMPLETE:
                self._disarm()
                self._buf = buf[pos:] if pos < n else b""
                self._start(reader.take())
                return
            elif event == FAILED:
                self._buf = b""
                error = reader.error
                assert error is not None
                self._refuse(error, reader.message)
                return
        self._buf = buf[pos:] if pos < n else b""
        if self._closed:
            return
        if self._eof:  # the rest of a request that will never come
            self.abort(graceful=True)
        elif reader.message is not None or self._buf:
            if self._timer is None:
                msg = reader.message
                if msg is not None and msg.headers_done:
                    self._arm(self._limits.body_timeout_s, "The request body was not received in time.")
                else:
                    self._arm(self._limits.header_timeout_s, "The request headers were not received in time.")
        else:
            self.idle_since = self._loop.time()

    def _handoff(self, data: bytes) -> None:
        """Give the connection, and the bytes of the request that starts `data`, to aiohttp."""
        transport = self.transport
        if transport is None:
            return
        self._disarm()
        self._closed = True  # for this protocol: aiohttp owns the connection now
        self._front.connections.discard(self)
        if self._paused_reading:
            self._paused_reading = False
            transport.resume_reading()
        protocol = self._front.fallback()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(data)
        if self._eof:
            protocol.eof_received()
        self.transport = None

    def _start(self, msg: Message) -> None:
        endpoint = HOT_PATHS[msg.url]
        self._starting = (endpoint, msg.headers.get("x-request-id"))
        self.task = self._loop.create_task(self._run(msg, endpoint))
        self._http11 = msg.http11
        if self._eof:  # pipelined before the FIN: the client may have gone since
            self._watch_client()

    async def _run(self, msg: Message, endpoint: Endpoint) -> None:
        self._starting = None  # from here on the dispatcher counts it
        reply = self._reply = NativeSink(self, keep_alive=msg.keep_alive and not self._front.closing,
                                         http11=msg.http11)
        request_id = choose_request_id(msg.headers.get("x-request-id"))
        try:
            await self._front.entry.dispatch(msg.headers, take_body(msg), endpoint, reply, request_id)
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
            self._reply = None
            if self._watch is not None:
                self._watch.stop()
                self._watch = None
        if not self._closed:
            if self._paused_reading and self.transport is not None:
                self._paused_reading = False
                self.transport.resume_reading()
            self._read()

    def response_done(self, keep_alive: bool) -> None:
        """A response was written completely: close, or read what the client sent next (`_run`)."""
        if not keep_alive:
            self.abort(graceful=True)

    def _refuse(self, error: GatewayError, msg: Message | None) -> None:
        """Answer a request refused before it could be served, count it if it was a generation
        request, and close: the rest of what the client sends is not worth reading."""
        self._disarm()
        request_id = None
        if msg is not None:
            endpoint = HOT_PATHS.get(msg.url)
            if endpoint is not None:  # it began with a generation request line (`_HOT_STARTS`)
                request_id = choose_request_id(msg.headers.get("x-request-id"))
                self._front.entry.refused(endpoint, error.status, request_id)
        if self.transport is not None and not self._closed:
            self.transport.write(error_bytes(error, request_id))
        self.abort(graceful=True)

    # -- writing and closing ------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.transport is None or self._closed:
            raise ConnectionResetError("client closed the connection")
        self.transport.write(data)

    @property
    def congested(self) -> bool:
        """The transport's buffer is above its high-water mark: `drain` would wait."""
        return self._drain is not None and not self._drain.done()

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionResetError("client closed the connection")
        if self._drain is not None and not self._drain.done():
            await self._drain
            if self._closed:
                raise ConnectionResetError("client closed the connection")

    def _arm(self, after_s: float, message: str) -> None:
        self._disarm()
        self._timer = self._loop.call_later(after_s, self._timed_out, message)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self, message: str) -> None:
        self._timer = None
        if self.task is None and not self._closed:  # timers run only while a request is being read
            self._refuse(RequestTimeout(message), self._reader.message)

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
