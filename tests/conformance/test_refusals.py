"""Requests both fronts refuse, identically: ambiguous framing (CL with TE, differing Content-Lengths),
unparseable input, oversized request lines, header fields, header sections and bodies, slowloris
heads and truncated bodies. Each gets an OpenAI-shaped 4xx and a closed connection, and a refused
generation request is counted exactly once in `gateway_requests_total`."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.harness import GatewayProcess

from .client import CHAT, Conn, assert_openai_error, chat, chunked, get, request
from .conftest import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_BODY, MAX_HEAD, MAX_LINE
from .test_messages import address, is_chat

BIG = "a" * (MAX_LINE + 100)
MANY = tuple((f"X-Filler-{i}", "b" * 500) for i in range(MAX_HEAD // 500 + 1))
OVER = {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
CHAT_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"

CASES = [
    # (id, bytes, status, code, a generation request)
    ("cl-and-te", CHAT_HEAD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, None, True),
    ("differing-content-lengths", CHAT_HEAD + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", 400, None, True),
    ("bad-chunk-size", CHAT_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", 400, None, True),
    ("not-http", b"\x16\x03\x01\x02\x00 not http at all\r\n\r\n", 400, None, False),
    ("upgrade-with-a-body", chat(headers=(("Connection", "Upgrade"), ("Upgrade", "h2c"))), 400, None, True),
    ("request-line", b"POST /v1/chat/completions?q=" + b"q" * MAX_LINE + b" HTTP/1.1\r\n\r\n",
     431, "request_headers_too_large", True),
    ("request-line-other", get("/v1/models?q=" + "q" * MAX_LINE), 431,
     "request_headers_too_large", False),
    ("header-field", chat(headers=(("X-Big", BIG),)), 431, "request_headers_too_large", True),
    ("header-field-other", get("/v1/models", headers=(("X-Big", BIG),)), 431, "request_headers_too_large", False),
    ("header-section", chat(headers=MANY), 431, "request_headers_too_large", True),
    ("header-section-other", get("/health", headers=MANY), 431, "request_headers_too_large", False),
    ("body-by-length", chat(OVER), 413, "request_too_large", True),
    ("body-by-length-with-expect", chat(OVER, headers=(("Expect", "100-continue"),)), 413, "request_too_large", True),
    ("body-chunked", request("POST", "/v1/chat/completions", chunked(json.dumps(OVER).encode(), 1000),
                             headers=(("Transfer-Encoding", "chunked"),), length=False),
     413, "request_too_large", True),
]


@pytest.mark.parametrize(("data", "status", "code", "generation"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_requests_get_an_openai_4xx_a_close_and_one_count(
    gw: GatewayProcess, data: bytes, status: int, code: str | None, generation: bool
) -> None:
    before = gw.metric("gateway_requests_total", status=str(status))
    with Conn(address(gw)) as c:
        c.send(data)
        resp = c.read_response()
        assert_openai_error(resp, status, code)
        assert resp.interim == []  # no 100 Continue for a request already refused
        assert (resp.header("connection") or "").lower() == "close"
        assert c.closed_by_server()
    assert gw.metric("gateway_requests_total", status=str(status)) == before + (1 if generation else 0)


def test_a_refused_request_behind_good_ones_is_answered_after_them(gw: GatewayProcess) -> None:
    with Conn(address(gw)) as c:
        c.send(chat() + get("/health") + chat(headers=(("X-Big", BIG),)))
        assert is_chat(c.read_response())
        assert c.read_response().status == 200
        assert_openai_error(c.read_response(), 431, "request_headers_too_large")
        assert c.closed_by_server()


def test_slowloris_headers_get_408_once_the_header_timeout_passes(gw: GatewayProcess) -> None:
    """The head trickles in, a byte whenever 0.1 s pass without an answer (a read timeout paces it)."""
    before = gw.metric("gateway_requests_total", status="408")
    trickle = b"X-Slow: " + b"s" * 1000
    with Conn(address(gw), timeout=0.1) as c:
        c.send(CHAT_HEAD)
        started = time.monotonic()
        for byte in trickle:
            try:
                c.buf += c.sock.recv(65536)
                break
            except TimeoutError:
                c.send(bytes([byte]))
        elapsed = time.monotonic() - started
        c.sock.settimeout(5)
        resp = c.read_response()
    assert_openai_error(resp, 408, "request_timeout")
    assert HEADER_TIMEOUT_S * 0.9 <= elapsed < HEADER_TIMEOUT_S + 2
    assert gw.metric("gateway_requests_total", status="408") == before + 1


def test_a_truncated_body_gets_408_and_the_close_that_follows_counts_nothing(gw: GatewayProcess) -> None:
    before = gw.metric("gateway_requests_total", status="408")
    total = gw.metric("gateway_requests_total")
    with Conn(address(gw)) as c:
        c.send(chat()[:-10])  # Content-Length promises 10 bytes more
        started = time.monotonic()
        resp = c.read_response()
        assert time.monotonic() - started >= BODY_TIMEOUT_S * 0.9
        assert_openai_error(resp, 408, "request_timeout")
        assert c.closed_by_server()
    with Conn(address(gw)) as c:  # the next client is served, and only the two requests are counted
        c.send(chat())
        assert is_chat(c.read_response())
    assert gw.metric("gateway_requests_total", status="408") == before + 1
    assert gw.metric("gateway_requests_total") == total + 2
