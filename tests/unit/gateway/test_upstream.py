"""gateway.upstream against raw asyncio servers on real loopback sockets.

Every async test runs twice: on pytest-asyncio's default loop, and on uvloop (the gateway's loop)
through `test_on_uvloop`. Servers synchronise with the client through asyncio.Event, never sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import shutil
import socket
import ssl
import struct
import subprocess
from asyncio import StreamReader as Reader
from asyncio import StreamWriter as Writer
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import uvloop

from gateway.client import (
    HIGH_WATER_BYTES,
    UpstreamConnectError,
    UpstreamLocalExhaustion,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResetError,
    UpstreamResponse,
)
from gateway.client.pool import IDLE_TIMEOUT_S

Handler = Callable[[Reader, Writer], Awaitable[None]]


class Upstream:
    """A raw HTTP/1.1 server on a free loopback port; counts the connections it accepted."""

    def __init__(self) -> None:
        self.origin = ""
        self.accepted = 0


Serve = Callable[[Handler], Awaitable[Upstream]]


@contextlib.asynccontextmanager
async def servers(tls: ssl.SSLContext | None = None) -> AsyncIterator[Serve]:
    started: list[asyncio.Server] = []
    tasks: set[asyncio.Task[None]] = set()

    async def serve(handler: Handler) -> Upstream:
        upstream = Upstream()

        async def on_connect(reader: Reader, writer: Writer) -> None:
            upstream.accepted += 1
            task = asyncio.current_task()
            assert task is not None
            tasks.add(task)
            try:
                await handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
                pass  # a cancelled handler ends quietly: asyncio's stream callback would log its CancelledError
            finally:
                writer.close()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=tls)
        started.append(server)
        upstream.origin = f"{'https' if tls else 'http'}://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return upstream

    try:
        yield serve
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for server in started:
            server.close()
            await server.wait_closed()


async def read_request(reader: Reader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


def ok(body: bytes, *headers: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in headers) + b"Content-Length: %d\r\n\r\n%b" % (
        len(body), body)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def answering(body: bytes = b"hello") -> Handler:
    """Answer every request on the connection with `body`."""
    async def handler(reader: Reader, writer: Writer) -> None:
        while True:
            await read_request(reader)
            writer.write(ok(body))
    return handler


async def until(condition: Callable[[], bool]) -> None:
    """Let the loop run until `condition` holds (an observable state, not a guess at a delay)."""
    async with asyncio.timeout(5):
        while not condition():  # noqa: ASYNC110 - what is awaited here has no event to wait on
            await asyncio.sleep(0)


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    async with servers() as start:
        yield start


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    upstream_pool = UpstreamPool()
    yield upstream_pool
    await upstream_pool.close()


# -- bodies and heads --------------------------------------------------------------------------


async def test_sends_the_head_as_given_and_reads_a_content_length_body(serve: Serve, pool: UpstreamPool) -> None:
    heads: list[bytes] = []

    async def handler(reader: Reader, writer: Writer) -> None:
        while True:
            head, body = await read_request(reader)
            heads.append(head + body)
            writer.write(ok(b'{"ok":true}', b"Content-Type: application/json", b"X-Dup: a", b"x-dup: b"))

    up = await serve(handler)
    resp = await pool.request(up.origin + "/prefix/", "POST", "/v1/chat", {"Content-Type": "application/json",
                              "content-length": "999", "X-Request-Id": "r1"}, b"{}")
    assert (resp.status, resp.headers["content-type"], resp.headers["x-dup"]) == (200, "application/json", "a, b")
    assert await resp.read() == b'{"ok":true}'
    assert resp.done
    resp.close()
    host = up.origin.removeprefix("http://").encode()
    assert heads[0] == (b"POST /prefix/v1/chat HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: application/json\r\n"
                        b"X-Request-Id: r1\r\nContent-Length: 2\r\n\r\n{}")
    for method, headers, line in [("POST", [], b"Content-Length: 0\r\n"), ("GET", [("host", "h.example")], b"")]:
        resp = await pool.request(up.origin, method, "/x", headers)
        assert await resp.read() == b'{"ok":true}'
        assert heads[-1].endswith(b"\r\n" + line + b"\r\n")
    assert heads[-1] == b"GET /x HTTP/1.1\r\nHost: h.example\r\n\r\n"  # the caller's Host wins
    assert up.accepted == 2  # one connection per origin string (the prefixed one is another origin)


async def test_running_out_of_descriptors_is_our_problem_not_the_upstreams(serve: Serve, pool: UpstreamPool) -> None:
    up = await serve(answering())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hog: list[socket.socket] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        with contextlib.suppress(OSError):
            while True:
                hog.append(socket.socket())
        with pytest.raises(UpstreamLocalExhaustion):
            await pool.request(up.origin, "POST", "/x", {})
    finally:
        for sock in hog:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert await (await pool.request(up.origin, "POST", "/x", {})).read() == b"hello"  # fine again


async def test_userinfo_in_the_origin_becomes_basic_auth_unless_the_caller_authorizes(
    serve: Serve, pool: UpstreamPool
) -> None:
    heads: list[bytes] = []

    async def handler(reader: Reader, writer: Writer) -> None:
        while True:
            head, _ = await read_request(reader)
            heads.append(head)
            writer.write(ok(b"{}"))

    up = await serve(handler)
    origin = up.origin.replace("http://", "http://us%40er:p%3Aw@")
    for headers in ({}, {"Authorization": "Bearer mine"}):
        await (await pool.request(origin, "POST", "/x", headers)).read()
    host = up.origin.removeprefix("http://").encode()
    assert b"Host: " + host + b"\r\n" in heads[0]  # no userinfo in Host
    assert b"Authorization: Basic dXNAZXI6cDp3\r\n" in heads[0]  # base64("us@er:p:w")
    assert b"Authorization: Bearer mine\r\n" in heads[1]
    assert b"Basic" not in heads[1]


@pytest.mark.parametrize(
    ("origin", "method", "headers", "needle"),
    [
        ("http://127.0.0.1:1", "POST", {"x-evil": "a\r\nHost: b"}, "CR or LF"),
        ("http://127.0.0.1:1", "HEAD", {}, "HEAD"),
        ("ftp://127.0.0.1:1", "POST", {}, "not an http"),
    ],
)
async def test_refuses_what_it_cannot_send_safely(
    pool: UpstreamPool, origin: str, method: str, headers: dict[str, str], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        await pool.request(origin, method, "/", headers)


async def test_chunked_body(serve: Serve, pool: UpstreamPool) -> None:
    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n") + b"0\r\n\r\n")
        await read_request(reader)
        writer.write(ok(b"again"))

    up = await serve(handler)
    resp = await pool.request(up.origin, "POST", "/", {})
    assert await resp.read() == b"data: 1\n\ndata: 2\n\n"
    resp = await pool.request(up.origin, "POST", "/", {})
    assert await resp.read() == b"again"
    assert up.accepted == 1


async def test_close_delimited_body_is_read_to_the_close_and_not_pooled(serve: Serve, pool: UpstreamPool) -> None:
    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")

    up = await serve(handler)
    resp = await pool.request(up.origin, "POST", "/", {})
    assert [chunk async for chunk in resp] in ([b"part one, ", b"part two"], [b"part one, part two"])
    assert resp.done
    assert pool.idle(up.origin) == 0


async def test_interim_1xx_is_skipped_and_204_has_no_body(serve: Serve, pool: UpstreamPool) -> None:
    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"final"))
        await read_request(reader)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")

    up = await serve(handler)
    resp = await pool.request(up.origin, "POST", "/", {})
    assert (resp.status, await resp.read()) == (200, b"final")
    resp = await pool.request(up.origin, "POST", "/", {})
    assert (resp.status, await resp.read(), pool.idle(up.origin)) == (204, b"", 1)


async def test_connection_close_response_is_not_pooled(serve: Serve, pool: UpstreamPool) -> None:
    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(ok(b"bye", b"Connection: close"))

    up = await serve(handler)
    resp = await pool.request(up.origin, "POST", "/", {})
    assert await resp.read() == b"bye"
    assert pool.idle(up.origin) == 0


# -- streaming ---------------------------------------------------------------------------------


def two_events(first_seen: asyncio.Event) -> Handler:
    """A stream of two events; the second exists only after the client has the first."""

    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        await first_seen.wait()
        writer.write(chunk(b"data: two\n\n") + b"0\r\n\r\n")

    return handler


async def test_readany_returns_each_sse_event_as_it_arrives(serve: Serve, pool: UpstreamPool) -> None:
    first_seen = asyncio.Event()
    up = await serve(two_events(first_seen))
    resp = await pool.request(up.origin, "POST", "/", {})
    assert await resp.readany() == b"data: one\n\n"
    first_seen.set()
    assert [chunk async for chunk in resp] == [b"data: two\n\n"]
    assert await resp.readany() == b""
    assert pool.idle(up.origin) == 1


async def test_close_mid_stream_closes_the_upstream_connection(serve: Serve, pool: UpstreamPool) -> None:
    saw_close = asyncio.Event()

    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        with contextlib.suppress(ConnectionError):
            assert await reader.read() == b""
        saw_close.set()

    up = await serve(handler)
    resp = await pool.request(up.origin, "POST", "/", {})
    assert await resp.readany() == b"data: one\n\n"
    resp.close()
    async with asyncio.timeout(5):
        await saw_close.wait()
    assert (resp.done, pool.idle(up.origin)) == (True, 0)
    with pytest.raises(UpstreamProtocolError):
        await resp.read()


def chunks_of(piece: bytes, pieces: int, *, hold: bool = False) -> Handler:
    """A chunked body of `pieces` copies of `piece`, written as fast as the client reads; with `hold`
    the connection then stays open until the client closes it."""

    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD)
        for _ in range(pieces):
            writer.write(chunk(piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        if hold:
            with contextlib.suppress(ConnectionError):
                await reader.read()

    return handler


async def test_slow_reader_pauses_the_socket_then_gets_every_byte(serve: Serve, pool: UpstreamPool) -> None:
    piece = bytes(range(256)) * 256  # 64 KiB
    pieces = 64  # 4 MiB: more than the response buffer and the kernel's socket buffers together
    up = await serve(chunks_of(piece, pieces))
    resp = await pool.request(up.origin, "POST", "/", {})
    conn = resp._conn
    assert conn is not None
    assert conn.transport is not None
    transport = conn.transport
    await until(lambda: not transport.is_reading())
    assert resp._size <= HIGH_WATER_BYTES + 256 * 1024  # at most one socket read past the mark
    assert await resp.read() == piece * pieces
    assert pool.idle(up.origin) == 1


async def test_pipe_hands_each_piece_over_from_the_read_callback_then_returns_at_the_end(
    serve: Serve, pool: UpstreamPool
) -> None:
    first_seen = asyncio.Event()
    up = await serve(two_events(first_seen))
    resp = await pool.request(up.origin, "POST", "/", {})
    got: list[bytes] = []
    flushes = 0

    def consume(data: bytes) -> bool:
        got.append(data)
        first_seen.set()
        return False

    async def flush() -> None:
        nonlocal flushes
        flushes += 1

    async with asyncio.timeout(5):
        await resp.pipe(consume, flush)
    assert (b"".join(got), flushes, resp.done, pool.idle(up.origin)) == (b"data: one\n\ndata: two\n\n", 0, True, 1)


async def test_pipe_waits_for_flush_when_the_consumer_is_full_and_loses_nothing(
    serve: Serve, pool: UpstreamPool
) -> None:
    piece = bytes(range(256)) * 64  # 16 KiB
    pieces = 64
    up = await serve(chunks_of(piece, pieces, hold=True))  # held open: the pool keeps the connection
    resp = await pool.request(up.origin, "POST", "/", {})
    got: list[bytes] = []
    flushing = False
    during_flush: list[bytes] = []

    def consume(data: bytes) -> bool:
        (during_flush if flushing else got).append(data)
        return True  # always full: every piece must wait for a flush

    async def flush() -> None:
        nonlocal flushing
        flushing = True
        await until(lambda: bool(resp._chunks) or resp._eof)  # more arrives (buffered) while it is full
        flushing = False

    async with asyncio.timeout(10):
        await resp.pipe(consume, flush)
    assert (during_flush, b"".join(got) == piece * pieces, pool.idle(up.origin)) == ([], True, 1)


@pytest.mark.parametrize("fails", ["consumer", "upstream", "cancelled"])
async def test_pipe_raises_what_failed_and_closes_the_response(serve: Serve, pool: UpstreamPool, fails: str) -> None:
    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        if fails == "upstream":
            writer.write(b"5\r\nab")
            writer.close()
            return
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the gateway side closes

    up = await serve(handler)
    resp = await pool.request(up.origin, "POST", "/", {})

    def consume(data: bytes) -> bool:
        if fails == "consumer":
            raise ConnectionResetError("client gone")
        return False

    async def flush() -> None:
        pass

    expected: type[BaseException] = {"consumer": ConnectionResetError, "upstream": UpstreamProtocolError,
                                      "cancelled": TimeoutError}[fails]
    with pytest.raises(expected):
        async with asyncio.timeout(0.5 if fails == "cancelled" else 5):
            await resp.pipe(consume, flush)
    assert (resp.done, pool.idle(up.origin)) == (True, 0)


# -- the pool ----------------------------------------------------------------------------------


async def test_sequential_requests_reuse_one_connection_with_nodelay(serve: Serve, pool: UpstreamPool) -> None:
    up = await serve(answering())
    for _ in range(3):
        resp = await pool.request(up.origin, "POST", "/", {}, b"x")
        assert await resp.read() == b"hello"
        resp.close()
    assert (up.accepted, pool.idle(up.origin), pool.connections_opened) == (1, 1, 1)
    conn = pool._origins[up.origin].idle[0]
    assert conn.transport is not None
    sock = conn.transport.get_extra_info("socket")
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


async def test_fifty_concurrent_requests(serve: Serve, pool: UpstreamPool) -> None:
    async def echo(reader: Reader, writer: Writer) -> None:
        while True:
            _, body = await read_request(reader)
            writer.write(ok(body))

    up = await serve(echo)

    async def one(i: int) -> bytes:
        resp = await pool.request(up.origin, "POST", "/", {}, b"body %d" % i)
        try:
            return await resp.read()
        finally:
            resp.close()

    assert await asyncio.gather(*(one(i) for i in range(50))) == [b"body %d" % i for i in range(50)]
    assert 1 <= up.accepted <= 50
    assert pool.idle(up.origin) == up.accepted


async def test_idle_limits(serve: Serve) -> None:
    up = await serve(answering())
    small = UpstreamPool(max_idle_per_origin=1)
    expired = UpstreamPool(idle_timeout_s=-1.0)  # every idle connection is already too old
    try:
        resps = await asyncio.gather(*(small.request(up.origin, "POST", "/", {}) for _ in range(3)))
        for resp in resps:
            await resp.read()
        assert small.idle(up.origin) == 1
        for _ in range(2):
            await (await expired.request(up.origin, "POST", "/", {})).read()
        assert expired.connections_opened == 2
    finally:
        await small.close()
        await expired.close()


async def test_idle_connection_closed_by_the_server_is_dropped_not_reused(serve: Serve, pool: UpstreamPool) -> None:
    closed = asyncio.Event()

    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(ok(b"once"))
        await writer.drain()
        writer.close()
        closed.set()

    up = await serve(handler)
    assert await (await pool.request(up.origin, "POST", "/", {})).read() == b"once"
    await closed.wait()
    await until(lambda: pool.idle(up.origin) == 0)  # the server's FIN drops the idle connection
    assert await (await pool.request(up.origin, "POST", "/", {})).read() == b"once"
    assert up.accepted == 2


async def test_reused_connection_closed_as_we_send_is_never_resent(serve: Serve, pool: UpstreamPool) -> None:
    """The server read the request and hung up unanswered: it may have acted on it, so the client
    gets the failure and the request is not sent again anywhere (it reached the server once)."""
    requests = 0

    async def handler(reader: Reader, writer: Writer) -> None:
        nonlocal requests
        await read_request(reader)
        requests += 1
        writer.write(ok(b"fine"))
        await read_request(reader)  # read the next request on this connection, then hang up unanswered
        requests += 1

    up = await serve(handler)
    assert await (await pool.request(up.origin, "POST", "/", {})).read() == b"fine"
    with pytest.raises(UpstreamResetError, match="before the response"):
        await pool.request(up.origin, "POST", "/", {})
    assert requests == 2
    assert up.accepted == 1


async def test_idle_connections_expire_before_the_runtimes_keep_alive() -> None:
    assert IDLE_TIMEOUT_S < 5.0  # uvicorn's timeout_keep_alive, which vLLM, SGLang and trtllm-serve use
    assert UpstreamPool()._idle_timeout_s == IDLE_TIMEOUT_S


async def test_closed_pool_refuses_requests(serve: Serve) -> None:
    up = await serve(answering())
    closing = UpstreamPool()
    await (await closing.request(up.origin, "POST", "/", {})).read()
    await closing.close()
    assert closing.idle(up.origin) == 0
    with pytest.raises(UpstreamConnectError, match="closed"):
        await closing.request(up.origin, "POST", "/", {})


# -- failures ----------------------------------------------------------------------------------


async def test_refused_port_is_a_connect_error(pool: UpstreamPool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        await pool.request(f"http://127.0.0.1:{port}", "POST", "/", {})


@pytest.mark.parametrize("reset", [False, True], ids=["eof", "reset"])
async def test_connection_closed_after_the_request_before_the_head_is_a_reset(
    serve: Serve, pool: UpstreamPool, reset: bool
) -> None:
    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        if reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()

    up = await serve(handler)
    with pytest.raises(UpstreamResetError, match="before the response"):
        await pool.request(up.origin, "POST", "/", {})
    assert up.accepted == 1  # never resent


@pytest.mark.parametrize(
    "answer",
    [ok(b"0123456789")[:-4], CHUNKED_HEAD + chunk(b"data: 1\n\n") + b"5\r\nab"],
    ids=["content-length", "chunked"],
)
async def test_truncated_body_is_a_protocol_error(serve: Serve, pool: UpstreamPool, answer: bytes) -> None:
    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(answer)

    up = await serve(handler)
    resp = await pool.request(up.origin, "POST", "/", {})
    with pytest.raises(UpstreamProtocolError, match="mid-response"):
        await resp.read()


@pytest.mark.parametrize("answer", [b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Le"], ids=["malformed", "cut"])
async def test_bad_or_cut_head_is_a_protocol_error(serve: Serve, pool: UpstreamPool, answer: bytes) -> None:
    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(answer)

    up = await serve(handler)
    with pytest.raises(UpstreamProtocolError):
        await pool.request(up.origin, "POST", "/", {})
    assert pool.idle(up.origin) == 0


# -- cancellation --------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["head", "body"])
async def test_cancelling_mid_request_closes_the_connection(serve: Serve, pool: UpstreamPool, stage: str) -> None:
    got_request, saw_close = asyncio.Event(), asyncio.Event()

    async def handler(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        if stage == "body":
            writer.write(ok(b"0123456789")[:-5])
        got_request.set()
        with contextlib.suppress(ConnectionError):
            await reader.read()
        saw_close.set()

    up = await serve(handler)
    responses: list[UpstreamResponse] = []

    async def call() -> None:
        resp = await pool.request(up.origin, "POST", "/", {})
        responses.append(resp)
        await resp.read()

    task = asyncio.create_task(call())
    await got_request.wait()
    await until(lambda: bool(responses) or stage == "head")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(5):
        await saw_close.wait()
    assert pool.idle(up.origin) == 0


# -- https ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command")
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


async def test_https_origin(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    async with servers(tls=server_side) as start:
        up = await start(answering(b"secret"))
        pool = UpstreamPool(ssl_context=ssl.create_default_context(cafile=str(cert)))
        try:
            for _ in range(2):
                assert await (await pool.request(up.origin, "POST", "/", {})).read() == b"secret"
            assert up.accepted == 1
        finally:
            await pool.close()
        with pytest.raises(UpstreamConnectError):  # the default context does not trust a self-signed certificate
            await UpstreamPool().request(up.origin, "POST", "/", {})


# -- the same tests on uvloop --------------------------------------------------------------------

ON_BOTH_LOOPS = [
    *(pytest.param(t, id=t.__name__.removeprefix("test_")) for t in (
        test_sends_the_head_as_given_and_reads_a_content_length_body,
        test_chunked_body,
        test_close_delimited_body_is_read_to_the_close_and_not_pooled,
        test_interim_1xx_is_skipped_and_204_has_no_body,
        test_connection_close_response_is_not_pooled,
        test_readany_returns_each_sse_event_as_it_arrives,
        test_close_mid_stream_closes_the_upstream_connection,
        test_slow_reader_pauses_the_socket_then_gets_every_byte,
        test_sequential_requests_reuse_one_connection_with_nodelay,
        test_fifty_concurrent_requests,
        test_idle_connection_closed_by_the_server_is_dropped_not_reused,
        test_reused_connection_closed_as_we_send_is_never_resent,
    )),
    pytest.param(functools.partial(test_connection_closed_after_the_request_before_the_head_is_a_reset, reset=True),
                 id="reset_before_the_head"),
    pytest.param(functools.partial(test_cancelling_mid_request_closes_the_connection, stage="head"),
                 id="cancelled_before_the_head"),
    pytest.param(functools.partial(test_cancelling_mid_request_closes_the_connection, stage="body"),
                 id="cancelled_mid_body"),
]


@pytest.mark.parametrize("scenario", ON_BOTH_LOOPS)
def test_on_uvloop(scenario: Callable[[Serve, UpstreamPool], Awaitable[None]]) -> None:
    async def main() -> None:
        async with servers() as start:
            upstream_pool = UpstreamPool()
            try:
                await scenario(start, upstream_pool)
            finally:
                await upstream_pool.close()

    uvloop.run(main())
