"""Hostile and broken clients: never a 500, never a crash, always the OpenAI error shape with a 4xx.

Covers what aiohttp's own parser answers (oversized headers, garbage), slow clients (slowloris
headers, a trickling body), the body size limit, out-of-range fields, and a client that reads nothing
of its stream while another stream completes. Raw sockets where an HTTP client would be too polite."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from .harness import Emulators, GatewayProcess, backend_entry, eventually
from .test_errors import assert_openai_error

StartGateway = Callable[..., GatewayProcess]
LIMITS = {"max_body_bytes": 4096, "max_header_bytes": 2048, "header_timeout_s": 0.5, "body_timeout_s": 0.5}


@pytest.fixture
def gw(emulators: Emulators, gateway: StartGateway) -> GatewayProcess:
    return gateway([backend_entry("v", emulators.start("vllm"), "vllm")], limits=LIMITS)


def address(gw: GatewayProcess) -> tuple[str, int]:
    host, port = gw.url.removeprefix("http://").split(":")
    return host, int(port)


def raw_exchange(gw: GatewayProcess, data: bytes, *, timeout: float = 10.0) -> tuple[int, dict[str, object]]:
    """Send `data`, read until the server closes; return the status and the JSON body."""
    with socket.create_connection(address(gw), timeout=timeout) as sock:
        sock.sendall(data)
        return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, dict[str, object]]:
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head.lower(), head
    return status, httpx.Response(status, content=body).json()


def test_oversized_header_is_431_openai_json(gw: GatewayProcess) -> None:
    resp = gw.get("/v1/models", headers={"x-big": "a" * 5000})
    assert resp.status_code == 431
    assert assert_openai_error(resp.json())["type"] == "invalid_request_error"


def test_oversized_request_line_is_431_openai_json(gw: GatewayProcess) -> None:
    status, body = raw_exchange(gw, b"GET /v1/models?" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 431
    assert_openai_error(body)


def test_garbage_is_400_openai_json(gw: GatewayProcess) -> None:
    status, body = raw_exchange(gw, b"\x16\x03\x01\x02\x00 not http at all\r\n\r\n")
    assert status == 400
    assert_openai_error(body)


def test_slowloris_headers_get_408_and_the_gateway_keeps_serving(gw: GatewayProcess) -> None:
    with socket.create_connection(address(gw), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        assert gw.get("/health").status_code == 200  # others are served meanwhile
        status, body = read_response(sock)  # the gateway answers and closes: no sleep, the read waits
        assert time.monotonic() - started < 5
    assert status == 408
    assert assert_openai_error(body)["code"] == "request_timeout"


def test_trickling_body_gets_408(gw: GatewayProcess) -> None:
    with socket.create_connection(address(gw), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        status, body = read_response(sock)
    assert status == 408
    assert assert_openai_error(body)["code"] == "request_timeout"


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_the_limit_is_413(gw: GatewayProcess, chunked: bool) -> None:
    body = b'{"model": "moe", "messages": [{"role": "user", "content": "' + b"x" * 8000 + b'"}]}'
    content: bytes | object = iter([body[:3000], body[3000:]]) if chunked else body
    resp = httpx.post(gw.url + "/v1/chat/completions", content=content,  # type: ignore[arg-type]
                      headers={"content-type": "application/json"}, timeout=10)
    assert resp.status_code == 413
    assert assert_openai_error(resp.json())["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "moe", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"model": "moe", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', "max_tokens"),
        (b'{"model": "moe", "messages": [{"role": "user", "content": "x"}], "n": 100000}', "n"),
        (b'{"model": "moe", "messages": "hello"}', "messages"),
        (b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "moe", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
        (b'{"model": "moe", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
        (b"[1, 2, 3]", None),
        (b"", None),
    ],
)
def test_wrong_fields_are_400(gw: GatewayProcess, body: bytes, param: str | None) -> None:
    resp = gw.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert assert_openai_error(resp.json())["param"] == param


@pytest.mark.parametrize(("method", "path", "status"), [
    ("DELETE", "/v1/chat/completions", 405), ("GET", "/v1/completions", 405), ("PUT", "/nope", 404),
    ("GET", "/v1/../../etc/passwd", 404),
])
def test_unknown_paths_and_methods(gw: GatewayProcess, method: str, path: str, status: int) -> None:
    resp = httpx.request(method, gw.url + path, timeout=10)
    assert resp.status_code == status
    assert_openai_error(resp.json())


def test_a_client_that_reads_nothing_does_not_block_other_streams(gw: GatewayProcess) -> None:
    request = (b'{"model": "moe", "stream": true, "max_tokens": 2000, "ignore_eos": true, '
               b'"messages": [{"role": "user", "content": "long please"}]}')
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    stalled.settimeout(10)
    stalled.connect(address(gw))
    # The kernel takes up to tcp_wmem's maximum (4 MB here) of what the gateway writes to a socket
    # whose client reads nothing, and one 2000-token stream is ~0.4 MB: pipelined, enough of them
    # that the gateway really is left holding one, unwritten (one alone was all in the kernel in
    # 0.1 s, and the check below then raced the other stream).
    wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    pipelined = wmem_max // 400_000 + 4
    try:
        stalled.sendall((b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(request)}\r\n\r\n".encode() + request) * pipelined)
        eventually(lambda: gw.metric("gateway_backend_in_flight") >= 1)
        done = threading.Event()

        def other() -> None:
            with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=30, json={
                "model": "moe", "stream": True, "max_tokens": 50,
                "messages": [{"role": "user", "content": "short"}],
            }) as resp:
                lines = list(resp.iter_lines())
            assert lines[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in lines
            done.set()

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(30)
        assert done.is_set()
        # the stalled client's streams go on, one after another, until one is paused on its full socket
        # (between two of them the count is 0 for an instant)
        eventually(lambda: gw.metric("gateway_backend_in_flight") >= 1)
        assert gw.metric("gateway_requests_total", status="200") < pipelined + 1  # not all of them served
    finally:
        stalled.close()
    eventually(lambda: gw.metric("gateway_backend_in_flight") == 0)


