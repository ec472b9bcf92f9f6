"""One keep-alive connection to one origin: an asyncio Protocol feeding one httptools (llhttp)
response parser, reused for every response the connection carries; and the request head we write."""

from __future__ import annotations

import asyncio
import base64
import collections
import ssl
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final, cast
from urllib.parse import unquote, urlsplit

import httptools

from .errors import UpstreamProtocolError, UpstreamResetError
from .response import HIGH_WATER_BYTES, UpstreamResponse

if TYPE_CHECKING:
    from .pool import UpstreamPool

_NO_BODY_METHODS: Final = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
_OURS: Final = frozenset({"host", "content-length", "transfer-encoding"})


class Origin:
    """An origin "http(s)://host[:port][/prefix]" and its stack of idle connections."""

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
        self.idle: collections.deque[Connection] = collections.deque()


class Connection(asyncio.Protocol):
    """One keep-alive connection: feeds the socket's bytes to its parser, which fills `resp`."""

    __slots__ = ("closed", "idle_since", "origin", "parser", "paused", "pool", "pooled", "received", "resp",
                 "transport")

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: UpstreamResponse | None = None  # the response in flight; None while idle
        self.received = False  # any byte of `resp` arrived
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

    # -- asyncio.Protocol --------------------------------------------------------------------------

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
                resp.fail(UpstreamProtocolError(f"malformed response: {exc}"))

    def eof_received(self) -> None:
        if self.resp is None:  # idle: drop it now rather than when the transport reports the loss
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.connections_lost += 1
        self.pool.forget(self)
        resp, self.resp = self.resp, None
        if resp is None:
            return
        if resp.status and "content-length" not in resp.headers and "transfer-encoding" not in resp.headers:
            resp.finish()  # a body delimited by the connection's close
        elif resp.status or self.received:
            resp.fail(UpstreamProtocolError(f"connection closed mid-response ({exc or 'EOF'})"))
        else:  # the request was written: whether the upstream acted on it is unknown
            resp.fail(UpstreamResetError(f"connection closed before the response ({exc or 'EOF'})"))

    # -- httptools callbacks; `resp` is None here only for bytes after a complete response ----------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.resp is not None
        self.resp.header(name, value)

    def on_headers_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        status = self.parser.get_status_code()
        if status < 200:  # interim response: llhttp goes on to parse the final one
            resp.interim()
            return
        resp.headed(status, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        assert resp is not None
        if resp.feed(body) > HIGH_WATER_BYTES and not self.paused:
            self.paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp is None or not resp.status:
            return  # the end of an interim response
        self.resp = None
        resp.finish()
        if resp.keep_alive:
            if self.paused:
                self.resume()
            self.pool.release(self)
        else:
            self.close()


def request_head(o: Origin, method: str, path: str, headers: Sequence[tuple[str, str]] | Mapping[str, str],
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
