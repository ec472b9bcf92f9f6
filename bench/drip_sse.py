"""A cheap vLLM-shaped SSE upstream that sends every event in its own write, as a real engine does.

nginx sends a canned stream in one burst, so a proxy reads many events per `read()`; a serving
engine flushes one token at a time. This server answers `POST /v1/chat/completions` with the role
chunk, `max_tokens` token chunks (the request's, at most `--max-tokens`; `--tokens` when the request
names none; the last carries `finish_reason`), the usage chunk and `[DONE]`,
each event one HTTP/1.1 chunk written by its own `transport.write` (TCP_NODELAY), `--gap-ms` apart,
so that a proxy that keeps up reads them one by one (`bench overhead` checks this from the proxies'
read-syscall counts). `[DONE]` and the terminating zero-length chunk go in one write.

It is a bare asyncio protocol on uvloop with httptools (no aiohttp), so that its own CPU per event
stays small next to the proxies measured through it on a 2-core machine. Also answers GET /health
(200, empty), GET /metrics (minimal vLLM gauges) and GET /v1/models; anything else gets 404.

Two stream lengths through the same proxies give the marginal cost of one more chunk (`bench
overhead`'s c section), free of the per-request work.

`python -m bench.drip_sse [--port 0] [--tokens 64] [--max-tokens 4096] [--gap-ms 1]`
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
from typing import cast

import httptools
import orjson
import uvloop

from bench.upstream.bodies import METRICS, sse_events

HEAD = {"id": "chatcmpl-drip", "object": "chat.completion.chunk", "created": 1795974001, "model": "tiny-moe"}
MODELS = orjson.dumps({"object": "list", "data": [{"id": "tiny-moe", "object": "model", "owned_by": "vllm"}]})


MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens"\s*:\s*(\d+)')


class Streams:
    """Each stream length's writes, made once (`stream_writes`)."""

    def __init__(self, default: int, most: int) -> None:
        self.default, self.most = default, most
        self.made: dict[int, list[bytes]] = {}

    def writes(self, body: bytes) -> list[bytes]:
        m = MAX_TOKENS.search(body)
        n = min(int(m.group(1)), self.most) if m else self.default
        got = self.made.get(n)
        if got is None:
            got = self.made[n] = stream_writes(max(n, 1))
        return got


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def stream_writes(tokens: int) -> list[bytes]:
    """The bytes of each write after the response head, in order: role, tokens, usage, [DONE] + end.
    One SSE event per write; `len(stream_writes(n)) == n + 3` events are relayed per response."""
    writes = [_chunk(e) for e in sse_events(tokens, HEAD, {})]
    writes[-1] += b"0\r\n\r\n"
    return writes


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
               b"transfer-encoding: chunked\r\n\r\n")


def _plain(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 %b\r\ncontent-type: %b\r\ncontent-length: %d\r\n\r\n%b"
            % (status, content_type, len(body), body))


class DripProtocol(asyncio.Protocol):
    """One keep-alive connection; requests on it are answered in order (a new request's stream starts
    when the previous one has ended, as HTTP/1.1 without pipelining does)."""

    def __init__(self, streams: Streams, gap_s: float) -> None:
        self.streams, self.gap_s = streams, gap_s
        self.writes: list[bytes] = []  # the stream being sent
        self.body = b""
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.pending: list[tuple[bytes, bytes, bytes]] = []  # (method, url, body) of requests not yet answered
        self.streaming = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(_plain(b"400 Bad Request", b"text/plain", b"bad request"))
                self.transport.close()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.pending.append((self.parser.get_method(), self.url.split(b"?", 1)[0], self.body))
        self.url = self.body = b""
        if not self.streaming:
            self._next()

    def _next(self) -> None:
        while self.pending and self.transport is not None:
            method, path, body = self.pending.pop(0)
            if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
                self.streaming = True
                self.writes = self.streams.writes(body)
                self.transport.write(STREAM_HEAD + self.writes[0])
                self._schedule(1)
                return
            if path == b"/health":
                self.transport.write(_plain(b"200 OK", b"text/plain", b""))
            elif path == b"/metrics":
                self.transport.write(_plain(b"200 OK", b"text/plain; version=0.0.4", METRICS.encode()))
            elif path == b"/v1/models":
                self.transport.write(_plain(b"200 OK", b"application/json", MODELS))
            elif path == b"/version":  # (with /v1/models: how SMG tells a vLLM worker)
                self.transport.write(_plain(b"200 OK", b"application/json", b'{"version":"0.32.0"}'))
            else:
                self.transport.write(_plain(b"404 Not Found", b"text/plain", b"not found"))

    def _schedule(self, i: int) -> None:
        self.timer = asyncio.get_running_loop().call_later(self.gap_s, self._send, i)

    def _send(self, i: int) -> None:
        self.timer = None
        if self.transport is None:
            return
        self.transport.write(self.writes[i])
        if i + 1 < len(self.writes):
            self._schedule(i + 1)
        else:
            self.streaming = False
            self._next()


async def serve(port: int, streams: Streams, gap_s: float) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: DripProtocol(streams, gap_s), "127.0.0.1", port, backlog=4096)
    print(f"listening on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=64, help="token chunks when the request names no max_tokens")
    parser.add_argument("--max-tokens", type=int, default=4096, help="the most token chunks of one stream")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="pause between two writes of one stream")
    args = parser.parse_args()
    uvloop.run(serve(args.port, Streams(args.tokens, args.max_tokens), args.gap_ms / 1000))


if __name__ == "__main__":
    main()
