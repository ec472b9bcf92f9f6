"""Tiny fake backends on real sockets, for behaviour the emulators have no knob for."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from aiohttp import web

from .harness import LoopThread

CHAT_REPLY = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":0,"model":"tiny-moe","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
)


@dataclass
class RecordingBackend:
    """An OpenAI-speaking (vLLM-faced) backend that records the headers of every generation request."""

    url: str
    runner: web.AppRunner
    headers: list[dict[str, str]] = field(default_factory=list)
    probes: list[float] = field(default_factory=list)  # when each readiness probe arrived (monotonic)


async def start_recording_backend() -> RecordingBackend:
    seen: list[dict[str, str]] = []
    probes: list[float] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        await request.read()
        return web.Response(body=CHAT_REPLY, content_type="application/json")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def health(request: web.Request) -> web.Response:
        probes.append(time.monotonic())
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    backend = RecordingBackend(f"http://127.0.0.1:{port}", runner)
    backend.headers = seen
    backend.probes = probes
    return backend


@dataclass
class ResettingServer:
    """Answers GETs (health probes, metrics) with an empty 200, and resets every POST (RST via
    SO_LINGER 0) as soon as its request line arrives, before any response byte: a backend that
    looks healthy and dies between accepting a generation request and answering it."""

    port: int
    server: asyncio.Server
    accepted: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def start_resetting_server() -> ResettingServer:
    import socket
    import struct

    holder: list[ResettingServer] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = b""
        with contextlib.suppress(Exception):
            while True:
                line = await reader.readline()
                if not line.startswith(b"GET"):
                    break
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        if line:
            holder[0].accepted.append(1)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    holder.append(ResettingServer(port, server))
    return holder[0]


@dataclass
class CannedStreamServer:
    """Answers every POST with `body` as a whole `text/event-stream` response (Content-Length), head
    and body in one write: a short answer that reaches the gateway in one read. GETs get an empty 200."""

    port: int
    server: asyncio.Server
    body: bytes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def read_body(reader: asyncio.StreamReader) -> int:
    """Read a request's headers (its request line already read) and its Content-Length body; returns
    the body's length."""
    length = 0
    while (header := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = header.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return length


async def start_canned_stream_server(body: bytes) -> CannedStreamServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while line := await reader.readline():
                await read_body(reader)
                if line.startswith(b"POST"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return CannedStreamServer(server.sockets[0].getsockname()[1], server, body)


@dataclass
class HoldingStreamServer:
    """Answers every POST with a chunked `text/event-stream` head and one role event, then holds the
    stream open until the gateway closes it (an engine still thinking). `open` counts held streams,
    `received` the request bytes of the last POST."""

    port: int
    server: asyncio.Server
    open: int = 0
    received: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


HELD_EVENT = (b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"tiny-moe","choices":'
              b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n')


async def start_holding_stream_server() -> HoldingStreamServer:
    held: HoldingStreamServer

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while line := await reader.readline():
                length = await read_body(reader)
                if not line.startswith(b"POST"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    continue
                held.received = length
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                             b"\r\n%x\r\n%b\r\n" % (len(HELD_EVENT), HELD_EVENT))
                await writer.drain()
                held.open += 1
                try:
                    await reader.read()  # until the gateway closes the stream
                finally:
                    held.open -= 1
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    held = HoldingStreamServer(server.sockets[0].getsockname()[1], server)
    return held


def run(loop: LoopThread, coro: object) -> object:
    return loop.run(coro)  # type: ignore[arg-type]
