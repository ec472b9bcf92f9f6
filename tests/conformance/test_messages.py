"""HTTP/1.1 message handling, identical on both fronts: keep-alive, pipelining of any mix of requests,
chunked request bodies, `Expect: 100-continue`, HTTP/1.0, half-close and `Connection: close`.
Every response read is checked for a `Date` and one correct framing (`client.Conn.read_response`)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.integration.harness import GatewayProcess, eventually

from .client import CHAT, Conn, Response, chat, chunked, completion, get, request
from .conftest import Fleet

Check = Callable[[Response], bool]


def address(gw: GatewayProcess) -> tuple[str, int]:
    host, port = gw.url.removeprefix("http://").split(":")
    return host, int(port)


def is_chat(r: Response) -> bool:
    return r.status == 200 and r.json()["object"] == "chat.completion"


def is_completion(r: Response) -> bool:
    return r.status == 200 and r.json()["object"] == "text_completion"


def is_models(r: Response) -> bool:
    return r.status == 200 and r.json()["object"] == "list"


def is_health(r: Response) -> bool:
    return r.status == 200 and r.json() == {"status": "ok"}


def is_stream(r: Response) -> bool:
    return r.status == 200 and r.body.rstrip().endswith(b"data: [DONE]")


MIXED: list[tuple[bytes, Check]] = [
    (chat(), is_chat), (get("/v1/models"), is_models), (get("/health"), is_health), (completion(), is_completion),
    (chat(), is_chat), (chat({**CHAT, "stream": True}), is_stream), (get("/v1/models"), is_models), (chat(), is_chat),
]


def split_head(data: bytes) -> tuple[bytes, bytes]:
    end = data.index(b"\r\n\r\n") + 4
    return data[:end], data[end:]


def test_keep_alive_serves_one_request_after_another(gw: GatewayProcess) -> None:
    with Conn(address(gw)) as c:
        for data, check in MIXED:
            c.send(data)
            resp = c.read_response()
            assert check(resp), (resp.status, resp.body[:200])
            assert resp.header("connection") != "close"


@pytest.mark.parametrize("first", [0, 1], ids=["generation-first", "other-first"])
@pytest.mark.parametrize("piece", [0, 7], ids=["one-write", "7-byte-writes"])
def test_pipelined_requests_of_any_kind_are_answered_in_order(gw: GatewayProcess, first: int, piece: int) -> None:
    sequence = MIXED[first:] + MIXED[:first]
    data = b"".join(d for d, _ in sequence)
    with Conn(address(gw)) as c:
        if piece:
            for i in range(0, len(data), piece):
                c.send(data[i:i + piece])
        else:
            c.send(data)
        for _, check in sequence:
            resp = c.read_response()
            assert check(resp), (resp.status, resp.body[:200])


def test_a_chunked_request_body_is_read_and_the_connection_kept(gw: GatewayProcess) -> None:
    body = json.dumps(CHAT).encode()
    data = request("POST", "/v1/chat/completions", chunked(body, 10), length=False,
                   headers=(("Transfer-Encoding", "chunked"), ("Content-Type", "application/json")))
    with Conn(address(gw)) as c:
        c.send(data + data)
        assert is_chat(c.read_response())
        assert is_chat(c.read_response())


def test_expect_100_continue_is_answered_before_the_body_is_sent(gw: GatewayProcess) -> None:
    head, body = split_head(chat(headers=(("Expect", "100-continue"),)))
    with Conn(address(gw)) as c:
        c.send(head)
        assert c.interim() == 100
        c.send(body)
        resp = c.read_response()
        assert is_chat(resp)
        assert resp.interim == []


def test_100_continue_behind_a_running_request_waits_for_its_turn(gw: GatewayProcess) -> None:
    slow = chat({"model": "slow", "messages": CHAT["messages"], "max_tokens": 5, "stream": True})
    head, body = split_head(chat(headers=(("Expect", "100-continue"),)))
    with Conn(address(gw)) as c:
        c.send(slow + head)
        first = c.read_response()  # a 100 Continue sent early would come first and be recorded here
        assert is_stream(first)
        assert first.interim == []
        assert c.interim() == 100  # now it is the second request's turn
        c.send(body)
        second = c.read_response()
        assert is_chat(second)
        assert second.interim == []


def test_http10_without_keep_alive_closes_after_the_response(gw: GatewayProcess) -> None:
    with Conn(address(gw)) as c:
        c.send(chat(version="1.0"))
        assert is_chat(c.read_response(sent_version="1.0"))
        assert c.closed_by_server()


def test_http10_keep_alive_says_so_and_keeps_the_connection(gw: GatewayProcess) -> None:
    keep = (("Connection", "keep-alive"),)
    with Conn(address(gw)) as c:
        c.send(chat(version="1.0", headers=keep))
        resp = c.read_response(sent_version="1.0")
        assert is_chat(resp)
        assert (resp.header("connection") or "").lower() == "keep-alive"
        c.send(get("/health", version="1.0", headers=keep))
        assert is_health(c.read_response(sent_version="1.0"))


def test_http10_stream_is_delimited_by_the_close(gw: GatewayProcess) -> None:
    with Conn(address(gw)) as c:
        c.send(chat({**CHAT, "stream": True}, version="1.0"))
        resp = c.read_response(sent_version="1.0")
        assert "transfer-encoding" not in resp.headers
        assert "content-length" not in resp.headers
        assert is_stream(resp)


@pytest.mark.parametrize("data", [chat(), get("/v1/models"), chat() + get("/health") + chat()],
                         ids=["generation", "other", "pipelined"])
def test_a_half_closed_client_gets_its_responses_then_the_close(gw: GatewayProcess, data: bytes) -> None:
    expected = data.count(b" HTTP/1.1\r\n")
    with Conn(address(gw)) as c:
        c.send(data)
        c.half_close()
        for _ in range(expected):
            resp = c.read_response()
            assert resp.status == 200
            assert set(resp.interim) <= {100}  # a half-close may be probed with 100 Continue
        assert c.closed_by_server()


def test_a_half_closed_client_waiting_for_a_long_answer_still_gets_it(gw: GatewayProcess) -> None:
    """While it waits, the connection is probed (`100 Continue`): a half-closed client accepts it."""
    with Conn(address(gw)) as c:
        c.send(chat({"model": "slow", "messages": CHAT["messages"], "max_tokens": 40, "ignore_eos": True}))
        c.half_close()
        resp = c.read_response()
        assert resp.interim == [100]
        assert is_chat(resp)
        assert resp.json()["usage"]["completion_tokens"] == 40
        assert c.closed_by_server()


def test_a_client_that_closes_during_a_long_answer_is_gone_and_counted_so(gw: GatewayProcess, fleet: Fleet) -> None:
    """A FIN may be a half-close or a close; the fronts tell them apart and cancel for a close."""
    aborted = fleet.slow.stats.aborted
    closed = gw.metric("gateway_requests_total", status="client_closed")
    long = chat({"model": "slow", "messages": CHAT["messages"], "max_tokens": 2000, "ignore_eos": True})
    with Conn(address(gw)) as c:
        c.send(long)
        eventually(lambda: gw.metric("gateway_backend_in_flight", backend="slow") >= 1)
    eventually(lambda: fleet.slow.stats.aborted > aborted, timeout=5)
    eventually(lambda: gw.metric("gateway_requests_total", status="client_closed") == closed + 1)


@pytest.mark.parametrize("data", [chat(headers=(("Connection", "close"),)),
                                  get("/health", headers=(("Connection", "close"),))], ids=["generation", "other"])
def test_connection_close_is_honoured(gw: GatewayProcess, data: bytes) -> None:
    with Conn(address(gw)) as c:
        c.send(data + get("/health"))  # what follows a Connection: close is not answered
        resp = c.read_response()
        assert resp.status == 200
        assert (resp.header("connection") or "").lower() == "close"
        assert c.closed_by_server()
