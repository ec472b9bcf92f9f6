"""The native HTTP front on a real loopback socket, with a recording dispatcher and aiohttp behind it.

Raw sockets, because an HTTP client is too polite to send what these tests need: split request
lines, pipelined requests, HTTP/1.0, Expect: 100-continue, oversized and stalled headers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from backends.base import Endpoint
from gateway.errors import GatewayError, InvalidRequest
from gateway.http.aiohttp_server import GatewayServer
from gateway.http.native_front import Front
from gateway.proxy.sink import ResponseSink
from gateway.settings import Limits

LIMITS = Limits(max_body_bytes=4096, max_header_bytes=2048, header_timeout_s=0.3, body_timeout_s=0.3)
CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@dataclass
class Served:
    host: str
    port: int
    front: Front
    seen: list[tuple[Endpoint, dict[str, str], bytes, str]] = field(default_factory=list)
    refusals: list[tuple[Endpoint, int | str]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    def refused(self, endpoint: Endpoint, status: int | str, request_id: str | None) -> None:
        self.refusals.append((endpoint, status))

    async def dispatch(
        self, headers: Mapping[str, str], body: bytes, endpoint: Endpoint, reply: ResponseSink, request_id: str
    ) -> None:
        self.seen.append((endpoint, dict(headers), body, request_id))
        if body == b"stream":
            await reply.start(200, {"Content-Type": "text/event-stream"})
            await reply.write(b"data: 1\n\n")
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            await reply.write(b"data: 2\n\n")
            await reply.end()
        elif body == b"ticks":  # a stream that goes on writing until its client has gone
            await reply.start(200, {"Content-Type": "text/event-stream"})
            try:
                while True:
                    await reply.write(b"data: tick\n\n")
                    await asyncio.sleep(0.01)
            except (asyncio.CancelledError, ConnectionError):
                self.cancelled.set()
                raise
        elif body == b"fail":
            raise InvalidRequest("bad", param="model")
        else:
            reply.send(200, {"Content-Type": "application/json", "x-n": str(len(self.seen))}, body)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    holder: list[Served] = []

    class Relay:  # the front is built before the Served record that knows its port
        async def dispatch(
            self, headers: Mapping[str, str], body: bytes, endpoint: Endpoint, reply: ResponseSink, request_id: str
        ) -> None:
            await holder[0].dispatch(headers, body, endpoint, reply, request_id)

        def refused(self, endpoint: Endpoint, status: int | str, request_id: str | None) -> None:
            holder[0].refused(endpoint, status, request_id)

    relay = Relay()
    front = Front(relay, GatewayServer(runner, limits=LIMITS, refused=relay.refused), LIMITS)
    server = await asyncio.get_running_loop().create_server(front, "127.0.0.1", 0)
    served = Served("127.0.0.1", server.sockets[0].getsockname()[1], front)
    holder.append(served)
    yield served
    server.close()
    await front.shutdown(1.0)
    await runner.cleanup()


def post(path: str = "/v1/chat/completions", body: bytes = CHAT, *, extra: str = "", version: str = "1.1") -> bytes:
    head = f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


async def read_response(reader: asyncio.StreamReader) -> Response:
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while (size := int((await reader.readline()).strip(), 16)) > 0:
            parts.append(await reader.readexactly(size))
            await reader.readline()
        await reader.readline()
        body = b"".join(parts)
    else:
        body = await reader.read()
    return Response(status, headers, body)


async def connect(s: Served) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(s.host, s.port)


def error_of(resp: Response) -> Mapping[str, object]:
    error = json.loads(resp.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error  # type: ignore[no-any-return]


async def test_keep_alive_serves_requests_in_order_and_hands_other_paths_to_aiohttp(served: Served) -> None:
    reader, writer = await connect(served)
    writer.write(post(body=b"a"))
    assert (await read_response(reader)).body == b"a"
    writer.write(post("/v1/completions", body=b"b"))
    second = await read_response(reader)
    assert (second.status, second.body, second.headers["x-n"]) == (200, b"b", "2")
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # the connection now goes to aiohttp
    models = await read_response(reader)
    assert json.loads(models.body) == {"object": "list", "data": []}
    writer.close()
    assert [(e, b) for e, _, b, _ in served.seen] == [(Endpoint.CHAT, b"a"), (Endpoint.COMPLETIONS, b"b")]


async def test_pipelined_requests_in_one_write_are_answered_in_order(served: Served) -> None:
    reader, writer = await connect(served)
    writer.write(post(body=b"one") + post(body=b"two") + post(body=b"three"))
    bodies = [(await read_response(reader)).body for _ in range(3)]
    assert bodies == [b"one", b"two", b"three"]
    writer.close()


async def test_a_request_split_into_single_bytes_is_parsed(served: Served) -> None:
    reader, writer = await connect(served)
    for byte in post(body=b"split", extra="X-Request-Id: abc\r\n"):
        writer.write(bytes([byte]))
        await writer.drain()
    resp = await read_response(reader)
    assert resp.body == b"split"
    assert served.seen[0][1]["x-request-id"] == "abc"
    assert served.seen[0][3] == "abc"
    writer.close()


async def test_header_names_are_lower_cased_and_repeats_joined(served: Served) -> None:
    reader, writer = await connect(served)
    writer.write(post(extra="X-Session-Id: s1\r\nAccept: a\r\nACCEPT: b\r\n"))
    await read_response(reader)
    headers = served.seen[0][1]
    assert headers["x-session-id"] == "s1"
    assert headers["accept"] == "a, b"
    assert served.seen[0][3] not in ("", "x" * 129)  # no usable client id: a fresh one
    assert served.seen[0][3].count("-") == 1
    writer.close()


async def test_gateway_errors_are_openai_json_and_keep_the_connection(served: Served) -> None:
    reader, writer = await connect(served)
    writer.write(post(body=b"fail", extra="x-request-id: r1\r\n"))
    resp = await read_response(reader)
    assert resp.status == 400
    assert resp.headers["x-request-id"] == "r1"
    assert error_of(resp)["param"] == "model"
    writer.write(post(body=b"after"))
    assert (await read_response(reader)).body == b"after"
    writer.close()


async def test_http10_stream_is_close_delimited_and_http11_chunked(served: Served) -> None:
    served.release.set()
    reader, writer = await connect(served)
    writer.write(post(body=b"stream", version="1.0"))
    resp = await read_response(reader)
    assert "transfer-encoding" not in resp.headers
    assert resp.body == b"data: 1\n\ndata: 2\n\n"
    writer.close()
    reader, writer = await connect(served)
    writer.write(post(body=b"stream"))
    resp = await read_response(reader)
    assert resp.headers["transfer-encoding"] == "chunked"
    assert resp.body == b"data: 1\n\ndata: 2\n\n"
    writer.close()


@pytest.mark.parametrize(("body", "first"), [(b"ticks", b"data: tick\n\n"), (b"stream", b"data: 1\n\n")],
                         ids=["writing", "idle"])
async def test_client_leaving_mid_stream_cancels_the_request(served: Served, body: bytes, first: bytes) -> None:
    """A FIN alone may be a half-close. A stream that goes on writing shows the client has gone at
    its next write; an idle one (the engine silent: a long prefill, a queue) answers the FIN with an
    SSE comment, which a closed socket answers with an RST (`halfclose`). Either way the request is
    cancelled, and with it the upstream generation, at once."""
    reader, writer = await connect(served)
    writer.write(post(body=body))
    await reader.readuntil(first)
    writer.close()
    await asyncio.wait_for(served.cancelled.wait(), 5)


async def test_a_half_closed_client_of_an_idle_stream_gets_the_comment_and_the_rest(served: Served) -> None:
    reader, writer = await connect(served)
    writer.write(post(body=b"stream"))
    await reader.readuntil(b"data: 1\n\n\r\n")
    writer.write_eof()  # shutdown(SHUT_WR): it still reads
    assert await reader.readuntil(b"\r\n:\n\n\r\n") == b"3\r\n:\n\n\r\n"  # one chunk: a comment, skipped by SSE
    served.release.set()
    assert await reader.readuntil(b"0\r\n\r\n") == b"9\r\ndata: 2\n\n\r\n0\r\n\r\n"
    assert not served.cancelled.is_set()
    writer.close()


async def test_expect_100_continue_is_answered_before_the_body(served: Served) -> None:
    reader, writer = await connect(served)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    assert await reader.readline() == b"HTTP/1.1 100 Continue\r\n"
    assert await reader.readline() == b"\r\n"
    writer.write(b"body")
    assert (await read_response(reader)).body == b"body"
    writer.close()


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (post(extra="x-big: " + "a" * 3000 + "\r\n"), 431, None),
        (b"POST /v1/chat/completions?" + b"q" * 3000 + b" HTTP/1.1\r\n\r\n", 431, None),  # via aiohttp
        (post(body=b"x" * 5000), 413, "request_too_large"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, None),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nab", 408, "request_timeout"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", 408, "request_timeout"),
        (b"PO", 408, "request_timeout"),
    ],
    ids=["big-header", "big-url", "big-body", "bad-chunk", "stalled-body", "stalled-headers", "stalled-line"],
)
async def test_bad_or_stalled_requests_get_a_4xx_openai_error_and_a_close(
    served: Served, data: bytes, status: int, code: str | None
) -> None:
    reader, writer = await connect(served)
    writer.write(data)
    resp = await asyncio.wait_for(read_response(reader), 5)
    assert resp.status == status
    error = error_of(resp)
    if code is not None:
        assert error["code"] == code
    assert await reader.read() == b""  # closed
    assert served.seen == []
    writer.close()


async def test_shutdown_lets_running_requests_finish_and_closes_idle_ones(served: Served) -> None:
    idle_reader, idle_writer = await connect(served)
    idle_writer.write(post(body=b"a"))
    await read_response(idle_reader)
    reader, writer = await connect(served)
    writer.write(post(body=b"stream"))
    await reader.readuntil(b"data: 1\n\n")
    shutdown = asyncio.create_task(served.front.shutdown(5.0))
    assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # the idle connection is closed
    assert not shutdown.done()
    served.release.set()
    rest = await asyncio.wait_for(reader.read(), 5)
    assert rest.endswith(b"data: 2\n\n\r\n0\r\n\r\n")
    await asyncio.wait_for(shutdown, 5)
    assert not served.cancelled.is_set()
    writer.close()
    idle_writer.close()


def test_error_status_is_kept_for_unknown_codes() -> None:
    from gateway.http.wire import error_bytes, status_line

    error = GatewayError("x")
    error.status = 599
    assert error_bytes(error).startswith(b"HTTP/1.1 599 Unknown\r\n")
    assert status_line(200) == "HTTP/1.1 200 OK\r\n"


async def test_a_request_whose_client_resets_at_once_is_counted_exactly_once(served: Served) -> None:
    """A client that sends its request and resets at once: the request is counted exactly once,
    by the dispatcher, or by the front (client_closed) if the reset beat the request's task to the
    dispatcher (a task cancelled before its first step never runs its body)."""
    import socket
    import struct

    for _ in range(20):
        before = len(served.seen) + len(served.refusals)
        with socket.create_connection((served.host, served.port)) as sock:  # data and RST back to back
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.sendall(post(body=b"stream"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while len(served.seen) + len(served.refusals) == before:
            assert loop.time() < deadline, "the request was counted nowhere"
            await asyncio.sleep(0.001)
        assert len(served.seen) + len(served.refusals) == before + 1
    assert all(r == (Endpoint.CHAT, "client_closed") for r in served.refusals)
    served.release.set()
