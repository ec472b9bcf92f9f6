"""The request reader never reads past the end of a request, wherever the reads split the stream.

Both fronts rely on it to know where the next request starts (the native front hands those bytes
to aiohttp; our aiohttp protocol forwards only accepted requests), so it is checked here on a
pipeline of requests whose bodies contain the very CRLF CRLF it steps by, for every two-read split
and for random many-read splits."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.http.reader import COMPLETE, FAILED, HEADERS, MORE, Reader
from gateway.settings import Limits

LIMITS = Limits(max_body_bytes=4096, max_header_bytes=1024, max_header_section_bytes=2048)
TRICKY = b'{"x": "\r\n\r\n\r\n"}\r\n\r\n'  # CRLF CRLF inside a body, and at its end

REQUESTS = [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n%b" % (len(TRICKY), TRICKY),
    b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\n\r\n\r\n\r\r\n3;ext=1\r\n\r\n\r\r\n0\r\nTrailer: t\r\n\r\n",
    b"\r\nPOST /v1/chat/completions HTTP/1.1\r\nContent-Length: 0\r\n\r\n",  # an empty line before it
    b"POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\nbody",
]
BODIES = [TRICKY, b"", b"\r\n\r\n\r" + b"\r\n\r", b"", b"body"]
STREAM = b"".join(REQUESTS)
ENDS = [sum(len(r) for r in REQUESTS[:i + 1]) for i in range(len(REQUESTS))]


def read(chunks: list[bytes]) -> tuple[list[tuple[bytes, bytes, int]], list[bool]]:
    """Feed the reads in order; return (url, body, end offset) per request, and whether the owner
    saw 100-continue asked at HEADERS."""
    reader = Reader(LIMITS)
    done: list[tuple[bytes, bytes, int]] = []
    expects: list[bool] = []
    offset = 0
    for chunk in chunks:
        pos = 0
        while pos < len(chunk):
            pos = reader.feed(chunk, pos)
            assert reader.event != FAILED, reader.error
            if reader.event == HEADERS:
                assert reader.message is not None
                expects.append(reader.message.expect_continue)
            elif reader.event == COMPLETE:
                msg = reader.take()
                done.append((msg.url, b"".join(msg.body), offset + pos))
            else:
                assert reader.event == MORE
                assert pos == len(chunk)
        offset += len(chunk)
    return done, expects


def expected() -> list[tuple[bytes, bytes, int]]:
    urls = [b"/v1/chat/completions", b"/v1/models", b"/v1/completions", b"/v1/chat/completions", b"/x"]
    return list(zip(urls, BODIES, ENDS, strict=True))


def test_every_two_read_split_finds_every_request_exactly_where_it_ends() -> None:
    for cut in range(len(STREAM) + 1):
        done, _ = read([STREAM[:cut], STREAM[cut:]])
        assert done == expected(), cut


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_split_into_many_reads_finds_the_same_requests(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(points)]
    done, expects = read(chunks)
    assert done == expected()
    assert expects == [False, False, True]  # heads with a body still to come; only the last asks


def test_a_head_over_the_section_limit_is_refused_before_it_ends() -> None:
    reader = Reader(LIMITS)
    head = b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: %b\r\n" % (i, b"v" * 200) for i in range(12))
    reader.feed(head, 0)
    assert reader.event == FAILED
    assert reader.error is not None
    assert reader.error.status == 431
    assert reader.closed
