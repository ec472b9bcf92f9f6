"""One connection's requests, parsed by httptools one message at a time, under the gateway's limits.

Both fronts read requests with this: the native front to serve the generation endpoints, and our
aiohttp protocol (`aiohttp_server.GatewayProtocol`) in front of aiohttp's own parser, so that the
limits, the refusals and their OpenAI-shaped errors are the same whichever front a request meets.

httptools (llhttp) parses whatever it is given and cannot say where a message ended, so the reader
never gives it bytes past the point where the current message may end: a head ends at the first
CRLF CRLF, a Content-Length body after exactly that many bytes, a chunked body at one of its
CRLF CRLF (its last chunk and trailers end with one; an earlier match inside the data only makes a
shorter step). `feed` therefore stops exactly at the end of each request's head and of each request,
and its owner knows which bytes belong to the next request: the native front hands those to aiohttp
when they are not a generation request, and our aiohttp protocol gives aiohttp only the requests
before one it refuses.

Refused, with `error` set and nothing more parsed: an unparseable request, CL with TE, duplicate
Content-Length, any Transfer-Encoding but chunked (400, all llhttp's own rules); a request line or
header field over `max_header_bytes`, a head over `max_header_section_bytes` or more than
`MAX_HEADERS` fields (431); a body over `max_body_bytes`, by Content-Length or as it arrives (413);
an `Upgrade` request with a body (400: there is nothing to upgrade to, and llhttp would not parse the
body). An `Upgrade` request without a body is served as plain HTTP/1.1 (RFC 9110 7.8 lets a server
ignore the header).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import httptools

from ..errors import BodyTooLarge, GatewayError, HeadersTooLarge, InvalidRequest
from ..settings import Limits

HEAD_END: Final = b"\r\n\r\n"
MAX_HEADERS: Final = 128

# what `Reader.feed` stopped at
MORE: Final = 0  # everything given was consumed; the request being read (if any) is not complete
HEADERS: Final = 1  # a request's head is complete and its body follows
COMPLETE: Final = 2  # a request is complete: `take()` it
FAILED: Final = 3  # the request was refused: `error` says why, `message` is what was read of it


@dataclass(slots=True)
class Message:
    method: bytes
    url: bytes
    headers: Final[dict[str, str]]  # names lower-cased, repeats joined by ", "
    body: Final[list[bytes]]
    body_bytes: int
    fields: int
    keep_alive: bool
    http11: bool
    headers_done: bool
    expect_continue: bool  # HTTP/1.1 with `Expect: 100-continue` and a body still to come

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.headers = {}
        self.body = []
        self.body_bytes = 0
        self.fields = 0
        self.keep_alive = True
        self.http11 = True
        self.headers_done = False
        self.expect_continue = False


class _Stop(Exception):
    """Raised from a parser callback to stop parsing once the request is refused."""


class Reader:
    """Feeds one connection's bytes to httptools, never past the end of the current request."""

    def __init__(self, limits: Limits, *, keep_body: bool = True) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._max_line = limits.max_header_bytes
        self._max_head = limits.max_header_section_bytes
        self._max_body = limits.max_body_bytes
        self._keep_body = keep_body  # our aiohttp protocol only needs to know where requests end
        self.message: Message | None = None  # the request being read; None between requests
        self.last: Message | None = None  # the request read before it
        self.error: GatewayError | None = None
        self.event = MORE
        self.heads = 0  # request heads completed on this connection
        self.closed = False  # refused, or after a request without keep-alive: nothing more is read
        self._head_bytes = 0
        self._in_body = False
        self._remaining = -1  # bytes still due in a Content-Length body; -1: no such body
        self._tail = b""  # the last 3 bytes searched for CRLF CRLF (it may straddle two reads)

    def feed(self, data: bytes, pos: int = 0) -> int:
        """Parse `data[pos:]` up to the next event (`event`); returns the position after the bytes
        consumed: the end of `data` unless a request's head or the request itself ended earlier."""
        self.event = MORE
        n = len(data)
        parser = self._parser
        while pos < n and not self.closed:
            end = self._step_end(data, pos)
            piece = data if pos == 0 and end == n else data[pos:end]
            searching = self._remaining < 0  # for a CRLF CRLF (a head, or a chunked body)
            if not searching:
                self._remaining -= end - pos
            if not self._in_body:
                self._head_bytes += end - pos
            try:
                parser.feed_data(piece)
            except httptools.HttpParserCallbackError:
                pass  # a callback refused the request: `error` says why
            except httptools.HttpParserUpgrade:
                pass  # a request without a body asked to upgrade: it is served as plain HTTP/1.1
            except httptools.HttpParserError as exc:
                self._fail(InvalidRequest(f"Invalid HTTP request: {exc}"))
            pos = end
            if self.event != MORE:
                break
            if searching:  # it may straddle this read and the next
                self._tail = (self._tail + piece[-3:])[-3:]
            if not self._in_body and self._head_bytes > self._max_head:
                self._fail(self._head_too_large())
                break
        return pos

    def take(self) -> Message:
        """The request that just completed."""
        msg = self.last
        assert msg is not None
        return msg

    def _step_end(self, data: bytes, pos: int) -> int:
        """How far the parser may read: never past the end of the current request."""
        if self._remaining >= 0:
            return min(len(data), pos + self._remaining)
        tail = self._tail
        if tail:
            i = (tail + data[pos:pos + 3]).find(HEAD_END)
            if i >= 0:
                return pos + i + 4 - len(tail)
        i = data.find(HEAD_END, pos)
        return len(data) if i < 0 else i + 4

    def _head_too_large(self) -> GatewayError:
        return HeadersTooLarge(f"Request header fields too large: the request head is over "
                               f"{self._max_head} bytes.")

    def _fail(self, error: GatewayError) -> None:
        self.error = error
        self.event = FAILED
        self.closed = True

    def _stop(self, error: GatewayError) -> None:
        self._fail(error)
        raise _Stop

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.message = Message()

    def on_url(self, url: bytes) -> None:
        msg = self.message
        assert msg is not None
        if not msg.url:
            msg.method = self._parser.get_method()
        msg.url += url
        if len(msg.url) > self._max_line:
            self._stop(HeadersTooLarge(f"Request header fields too large: the request line is over "
                                       f"{self._max_line} bytes."))

    def on_header(self, name: bytes, value: bytes) -> None:
        msg = self.message
        assert msg is not None
        if len(name) + len(value) > self._max_line:
            self._stop(HeadersTooLarge(f"Request header fields too large: a header field is over "
                                       f"{self._max_line} bytes."))
        msg.fields += 1
        if msg.fields > MAX_HEADERS:
            self._stop(HeadersTooLarge(f"Request header fields too large: more than {MAX_HEADERS} fields."))
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers = msg.headers
        headers[key] = headers[key] + ", " + text if key in headers else text

    def on_headers_complete(self) -> None:
        msg = self.message
        assert msg is not None
        parser = self._parser
        msg.headers_done = True
        msg.keep_alive = parser.should_keep_alive()
        msg.http11 = parser.get_http_version() == "1.1"
        self.heads += 1
        self._in_body = True
        self._tail = b""
        if self._head_bytes > self._max_head:
            self._stop(self._head_too_large())
        headers = msg.headers
        chunked = "transfer-encoding" in headers  # llhttp refuses any other final coding, and CL with it
        length = -1 if chunked else int(headers.get("content-length", "0"))
        if parser.should_upgrade() and (chunked or length > 0):
            self._stop(InvalidRequest("Protocol upgrades are not supported: send the request without "
                                      "an Upgrade header."))
        if length > self._max_body:
            self._stop(BodyTooLarge(f"Request body too large: {length} bytes, the limit is {self._max_body}."))
        self._remaining = length if length > 0 else -1
        msg.expect_continue = (
            msg.http11 and (chunked or length > 0) and headers.get("expect", "").lower() == "100-continue"
        )
        self.event = HEADERS

    def on_body(self, body: bytes) -> None:
        msg = self.message
        assert msg is not None
        msg.body_bytes += len(body)
        if msg.body_bytes > self._max_body:
            self._stop(BodyTooLarge(f"Request body too large: the limit is {self._max_body} bytes."))
        if self._keep_body:
            msg.body.append(body)

    def on_message_complete(self) -> None:
        msg = self.message
        assert msg is not None
        self.last = msg
        self.message = None
        self.event = COMPLETE
        self._head_bytes = 0
        self._in_body = False
        self._remaining = -1
        self._tail = b""
        if not msg.keep_alive:
            self.closed = True  # llhttp would refuse what follows; the response closes the connection
