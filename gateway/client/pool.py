"""A lean HTTP/1.1 client for the request path: pooled keep-alive connections, each one asyncio
Protocol with one httptools (llhttp) response parser reused for every response it carries.

Why not aiohttp's ClientSession: it spends ~100 µs of CPU per proxied request; the gateway only needs
"send these bytes, give me the status, headers and body as it arrives". See bench/upstream_micro.py.

Errors (one tree; map them once at the proxy's edge)::

    UpstreamClientError
    ├── UpstreamLocalExhaustion  this process is out of descriptors or memory (not the upstream's fault)
    ├── UpstreamConnectError   refused, reset, DNS, TLS, connect timeout, pool closed, or the connection
    │                          closed before any byte of the response: the upstream provably answered nothing
    └── UpstreamProtocolError  malformed response, or the connection closed mid-head or mid-body (truncated)

Guarantees:
- `origin` is "http(s)://host[:port][/prefix]"; a path prefix is prepended to every `path`.
- `request()` resolves once the response head has arrived; the body follows through `read()`,
  `readany()` or `async for`. Interim 1xx responses are skipped.
- The request head carries the request line, `Host` (the caller's if given, else the origin's),
  `Content-Length` (always, except 0 on GET/DELETE/OPTIONS) and the caller's headers as given,
  less any `Content-Length`/`Transfer-Encoding` of theirs: we frame the body. HTTP/1.1 keep-alive.
- A connection goes back to its origin's idle stack (LIFO) as soon as the whole body has been
  received, if both sides allow keep-alive; the response keeps its buffered bytes. Idle connections
  that the peer closes, or that speak unasked, are dropped; ones idle longer than `idle_timeout_s`
  are closed when the pool is next used (no timers).
- A request on a reused connection that dies before any response byte is retried once on a new
  connection (the server closed its idle socket as we wrote). A fresh connection is never retried.
- `UpstreamResponse.close()` before the body's end, or cancelling `request()`/`read()`/`readany()`,
  aborts the connection (the upstream sees it close at once); it is never pooled.
- Flow control: past 256 KiB buffered and unread, reading from the socket pauses until it is read.
- Timeouts other than the TCP (and TLS) connect are the caller's (`asyncio.timeout`).
- Not supported (ValueError): HEAD, whose response httptools cannot be told has no body; CR/LF in the
  path or a header. Also not: upgrades, trailers, streamed request bodies.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import errno
import ssl
from collections.abc import Mapping, Sequence
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools

__all__ = ["UpstreamClientError", "UpstreamConnectError", "UpstreamPool", "UpstreamProtocolError", "UpstreamResponse"]

HIGH_WATER_BYTES = 256 * 1024
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
_OURS = frozenset({"host", "content-length", "transfer-encoding"})


class UpstreamClientError(Exception):
    """Base of every failure of this client."""


class UpstreamConnectError(UpstreamClientError):
    """No response byte arrived: connect failed, or the connection closed before the response."""


class UpstreamProtocolError(UpstreamClientError):
    """The response was malformed or cut short."""


class UpstreamLocalExhaustion(UpstreamClientError):
    """This process could not open a socket (out of file descriptors or memory): the upstream is not
    at fault, and another upstream would fail the same way."""


class _Stale(UpstreamConnectError):
    """A reused connection died before any response byte: retried once on a new connection."""


class _Origin:
    __slots__ = ("authorization", "host", "host_header", "idle", "key", "port", "prefix", "tls")

    def __init__(self, key: str, tls: ssl.SSLContext | None) -> None:
        parts = urlsplit(key)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"not an http(s) origin: {key!r}")
        self.key = key
        self.tls = tls if parts.scheme == "https" else None
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.host_header = parts.netloc.rpartition("@")[2]
        # user:password in the URL becomes Basic auth, unless the caller sends its own Authorization
        self.authorization = None
        if parts.username is not None:
            userinfo = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            self.authorization = "Basic " + base64.b64encode(userinfo).decode()
        self.prefix = parts.path.rstrip("/")
        self.idle: collections.deque[_Conn] = collections.deque()


class UpstreamResponse:
    """One response: status and headers (names lower-cased) now, the body as it arrives."""

    __slots__ = ("_chunks", "_conn", "_eof", "_exc", "_head", "_headers", "_keep_alive", "_raw_headers", "_size",
                 "_waiter", "status")

    def __init__(self, conn: _Conn, head: asyncio.Future[None]) -> None:
        self.status = 0  # 0 until the final (non-1xx) head has arrived
        self._raw_headers: list[tuple[bytes, bytes]] = []  # decoded only if someone asks (rarely)
        self._headers: dict[str, str] | None = None
        self._conn: _Conn | None = conn  # None once the body is complete, failed or closed
        self._head = head
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False  # nothing more will arrive
        self._exc: UpstreamClientError | None = None  # raised once the buffered bytes are read
        self._waiter: asyncio.Future[None] | None = None
        self._keep_alive = False

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

    async def readany(self) -> bytes:
        """The bytes received since the last call, as soon as there are any; b"" at the end."""
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            self._waiter = self._head.get_loop().create_future()
            try:
                await self._waiter
            except BaseException:
                self.close()
                raise
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return data

    async def read(self) -> bytes:
        """The whole remaining body."""
        if self._eof and self._exc is None:
            data = b"".join(self._chunks)
            self._chunks.clear()
            return data
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        data = await self.readany()
        if not data:
            raise StopAsyncIteration
        return data

    def close(self) -> None:
        """Release the response. Before the body's end this aborts the connection."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.resp = None
            conn.close()
        if not self._eof:
            self._fail(UpstreamProtocolError("response closed before its end"))
        self._chunks.clear()

    # called by the connection
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _finish(self) -> None:
        self._conn = None
        self._eof = True
        self._wake()

    def _fail(self, exc: UpstreamClientError) -> None:
        self._conn = None
        self._eof = True
        self._exc = exc
        if not self._head.done():
            self._head.set_exception(exc)
        self._wake()


class _Conn(asyncio.Protocol):
    """One keep-alive connection: feeds the socket's bytes to its parser, which fills `resp`."""

    __slots__ = ("closed", "idle_since", "origin", "parser", "paused", "pool", "pooled", "received", "resp", "reused",
                 "transport")

    def __init__(self, pool: UpstreamPool, origin: _Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: UpstreamResponse | None = None  # the response in flight; None while idle
        self.received = False  # any byte of `resp` arrived
        self.reused = False
        self.closed = False
        self.paused = False
        self.pooled = False  # in its origin's idle stack
        self.idle_since = 0.0

    def send(self, data: bytes) -> UpstreamResponse:
        resp = self.resp = UpstreamResponse(self, self.pool.loop.create_future())
        self.received = False
        assert self.transport is not None
        self.transport.write(data)
        return resp

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            self.pool.forget(self)

    def resume(self) -> None:
        self.paused = False
        if not self.closed and self.transport is not None:
            self.transport.resume_reading()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        if self.resp is None:  # idle: a server may not speak unasked
            self.close()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            resp = self.resp
            self.resp = None
            self.close()
            if resp is not None:
                resp._fail(UpstreamProtocolError(f"malformed response: {exc}"))

    def eof_received(self) -> None:
        if self.resp is None:  # idle: drop it now rather than when the transport reports the loss
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        resp, self.resp = self.resp, None
        if resp is None:
            return
        if resp.status and "content-length" not in resp.headers and "transfer-encoding" not in resp.headers:
            resp._finish()  # a body delimited by the connection's close
        elif resp.status or self.received:
            resp._fail(UpstreamProtocolError(f"connection closed mid-response ({exc or 'EOF'})"))
        else:
            error = _Stale if self.reused else UpstreamConnectError
            resp._fail(error(f"connection closed before the response ({exc or 'EOF'})"))

    # httptools callbacks; `resp` is None here only for bytes after a complete response
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.resp is not None
        self.resp._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        status = self.parser.get_status_code()
        if status < 200:  # interim response: llhttp goes on to parse the final one
            resp._raw_headers = []
            return
        resp.status = status
        resp._keep_alive = self.parser.should_keep_alive()
        if not resp._head.done():
            resp._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        assert resp is not None
        resp._chunks.append(body)
        resp._size += len(body)
        if resp._size > HIGH_WATER_BYTES and not self.paused:
            self.paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        resp._wake()

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp is None or not resp.status:
            return  # the end of an interim response
        self.resp = None
        resp._finish()
        if resp._keep_alive:
            if self.paused:
                self.resume()
            self.pool.release(self)
        else:
            self.close()


class UpstreamPool:
    """Keep-alive connections per origin; see the module docstring for what is guaranteed."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        max_idle_per_origin: int = 512,
        idle_timeout_s: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """Create it inside the running loop. `ssl_context` is for https origins (default:
        `ssl.create_default_context()`). Host names are resolved on each new connection (no DNS cache)."""
        self.connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle_per_origin
        self._idle_timeout_s = idle_timeout_s
        self._ssl = ssl_context
        self._origins: dict[str, _Origin] = {}
        self._closed = False
        self.loop = asyncio.get_running_loop()
        self.connections_opened = 0

    def idle(self, origin: str) -> int:
        """How many idle connections to `origin` the pool holds."""
        found = self._origins.get(origin)
        return len(found.idle) if found is not None else 0

    async def request(
        self,
        origin: str,
        method: str,
        path: str,
        headers: Sequence[tuple[str, str]] | Mapping[str, str],
        body: bytes = b"",
    ) -> UpstreamResponse:
        if self._closed:
            raise UpstreamConnectError("the upstream pool is closed")
        o = self._origins.get(origin) or self._add(origin)
        data = _head(o, method, path, headers, len(body))
        if body:
            data += body
        conn = self._take(o)
        if conn is not None:
            try:
                return await self._exchange(conn, data)
            except _Stale:
                pass
        return await self._exchange(await self._connect(o), data)

    async def close(self) -> None:
        """Close the idle connections; later requests fail. Busy ones close when their response ends."""
        self._closed = True
        for o in self._origins.values():
            while o.idle:
                conn = o.idle.pop()
                conn.pooled = False
                conn.close()
        await asyncio.sleep(0)  # let the transports report their loss before the loop may close

    async def _exchange(self, conn: _Conn, data: bytes) -> UpstreamResponse:
        resp = conn.send(data)
        try:
            await resp._head
        except BaseException:
            resp.close()
            raise
        return resp

    def _add(self, origin: str) -> _Origin:
        tls = None
        if origin[:6].lower() == "https:":
            tls = self._ssl = self._ssl or ssl.create_default_context()
        o = self._origins[origin] = _Origin(origin, tls)
        return o

    def _take(self, o: _Origin) -> _Conn | None:
        idle = o.idle
        while idle:
            conn = idle.pop()
            conn.pooled = False
            if self.loop.time() - conn.idle_since > self._idle_timeout_s:
                conn.close()  # the rest of the stack is older still
                continue
            conn.reused = True
            return conn
        return None

    async def _connect(self, o: _Origin) -> _Conn:
        conn = _Conn(self, o)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await self.loop.create_connection(
                    lambda: conn, o.host, o.port, ssl=o.tls, server_hostname=o.host if o.tls else None
                )
        except BaseException as exc:
            conn.close()  # cancelled just as the connection was made: do not leak it
            if isinstance(exc, OSError) and exc.errno in _LOCAL_ERRNOS:
                raise UpstreamLocalExhaustion(f"cannot open a socket to {o.key}: {exc!r}") from exc
            if isinstance(exc, OSError | TimeoutError):
                raise UpstreamConnectError(f"cannot connect to {o.key}: {exc!r}") from exc
            raise
        self.connections_opened += 1
        return conn

    # called by connections
    def release(self, conn: _Conn) -> None:
        idle = conn.origin.idle
        if self._closed or len(idle) >= self._max_idle:
            conn.close()
            return
        now = conn.idle_since = self.loop.time()
        while idle and now - idle[0].idle_since > self._idle_timeout_s:
            old = idle.popleft()
            old.pooled = False
            old.close()
        conn.pooled = True
        idle.append(conn)

    def forget(self, conn: _Conn) -> None:
        if conn.pooled:
            conn.pooled = False
            conn.origin.idle.remove(conn)


def _head(o: _Origin, method: str, path: str, headers: Sequence[tuple[str, str]] | Mapping[str, str],
          length: int) -> bytes:
    """The request head, as one encode of one join; rejects CR/LF smuggled into the path or headers."""
    if method == "HEAD":
        raise ValueError("HEAD is not supported: its response would be parsed as having a body")
    parts = [method, " ", o.prefix, path, " HTTP/1.1\r\nHost: ", o.host_header, "\r\n"]
    lines = 2
    authorization = o.authorization
    for name, value in headers.items() if type(headers) is dict or isinstance(headers, Mapping) else headers:
        lower = name.lower()
        if lower in _OURS:
            if lower == "host":
                parts[5] = value
            continue
        if lower == "authorization":
            authorization = None
        parts += (name, ": ", value, "\r\n")
        lines += 1
    if authorization is not None:
        parts += ("Authorization: ", authorization, "\r\n")
        lines += 1
    if length or method not in _NO_BODY_METHODS:
        parts += ("Content-Length: ", str(length), "\r\n")
        lines += 1
    parts.append("\r\n")
    text = "".join(parts)
    if text.count("\n") != lines + 1 or text.count("\r") != lines + 1:
        raise ValueError("CR or LF in the request path or a header")
    return text.encode("latin-1")
