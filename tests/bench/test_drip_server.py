"""bench/drip_sse.py as a real process on a real socket: each event arrives on its own, and the probe
`bench overhead` uses counts the whole answer as wrk will."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from bench import chat_bodies, drip_sse, measure, procs
from bench.targets import Target

GAP_MS = 100  # far above any scheduling delay of a busy 2-core machine, so arrivals stay apart
TOKENS = 3


@pytest.fixture
def drip(tmp_path: Path) -> Iterator[procs.PyServer]:
    server = procs.PyServer("drip", "bench.drip_sse", ["--tokens", str(TOKENS), "--gap-ms", str(GAP_MS)], tmp_path)
    try:
        yield server
    finally:
        server.stop()


def test_events_arrive_one_per_read_gap_apart_on_a_keep_alive_connection(drip: procs.PyServer) -> None:
    host, port = drip.url.removeprefix("http://").split(":")
    body = orjson.dumps(chat_bodies.stream(max_tokens=TOKENS))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for _ in range(2):  # the second answer on the same connection is whole too
            sock.sendall(head + body)
            reads: list[tuple[float, bytes]] = []
            while not (reads and reads[-1][1].endswith(b"0\r\n\r\n")):
                data = sock.recv(65536)
                assert data, "connection closed mid-stream"
                reads.append((time.monotonic(), data))
            assert len(reads) == TOKENS + 3  # role (with the head), tokens, usage, [DONE]
            assert all(data.count(b"data: ") == 1 for _, data in reads)
            gaps = [b[0] - a[0] for a, b in itertools.pairwise(reads)]
            assert min(gaps) >= 0.5 * GAP_MS / 1000  # the server waits the gap between writes


def test_the_probe_sees_the_whole_answer_and_its_size_on_the_wire(drip: procs.PyServer) -> None:
    p = measure.check(Target("direct", drip.url, drip.pid), orjson.dumps(chat_bodies.stream(max_tokens=TOKENS)),
                      stream=True)
    assert p.status == 200
    assert p.events == TOKENS + 3
    assert p.wire_bytes == len(drip_sse.STREAM_HEAD) + sum(len(w) for w in drip_sse.stream_writes(TOKENS))


def test_health_and_unknown_paths(drip: procs.PyServer) -> None:
    host, port = drip.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"not found"):
            chunk = sock.recv(65536)
            assert chunk
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 OK")
    assert b"HTTP/1.1 404 Not Found" in data


def test_the_stream_is_as_long_as_the_request_asks(drip: procs.PyServer) -> None:
    """Two lengths through one server: `bench overhead` takes the marginal cost per chunk from them."""
    for tokens in (1, TOKENS + 4):
        p = measure.check(Target("direct", drip.url, drip.pid), orjson.dumps(chat_bodies.stream(max_tokens=tokens)),
                          stream=True)
        assert p.events == tokens + 3
    streams = drip_sse.Streams(default=5, most=8)
    assert len(streams.writes(b'{"stream": true}')) == 5 + 3
    assert len(streams.writes(b'{"max_tokens": 100}')) == 8 + 3
    assert streams.writes(b'{"max_completion_tokens": 2}') is streams.writes(b'{"max_tokens":2}')
