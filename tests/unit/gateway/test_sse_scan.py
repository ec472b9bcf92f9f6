"""The scan of a run of ordinary token events (gateway/proxy/sse_scan.py): the C extension and the
Python reference against an oracle written from the definition (one event at a time, split at its
blank line), on generated reads; and which of the two the build runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import build_check
from gateway.proxy import sse_scan

PREFIX = b'data: {"id":"c","model":"m","choices":[{"delta":{"content":"'
SUFFIX = b'"}}]}\n\n'
CLIENT = b'data: {"id":"c","model":"client-name","choices":[{"delta":{"content":"'
MAX_TEXT = 8
SCANS = [("reference", sse_scan.reference_run), ("runs", sse_scan.ordinary_run)]


def oracle(buf: bytes, pos: int, stop: int, client: bytes | None) -> tuple[int, int, bytes | None]:
    """From the definition: an event ends at the first blank line; it is ordinary when it is the prefix,
    1..MAX_TEXT bytes of text not starting with a quote, and the suffix."""
    count, out = 0, b""
    while True:
        while pos < stop and buf[pos] == 10:
            out += b"\n"
            pos += 1
        end = buf.find(b"\n\n", pos, stop)
        if end < 0:
            break
        event = buf[pos:end + 2]
        text = len(event) - len(PREFIX) - len(SUFFIX)
        if not (event.startswith(PREFIX) and event.endswith(SUFFIX) and 1 <= text <= MAX_TEXT
                and event[len(PREFIX)] != 34):
            break
        out += (client or PREFIX) + event[len(PREFIX):]
        count += 1
        pos = end + 2
    return pos, count, (out if client is not None and count else None)


QUOTE_LF_BACKSLASH = bytes.maketrans(b"\x00\x01\x02", b'"\n\\')
texts = st.binary(min_size=0, max_size=MAX_TEXT + 2).map(lambda b: b.translate(QUOTE_LF_BACKSLASH))
event = st.one_of(
    texts.map(lambda t: PREFIX + t + SUFFIX),  # ordinary, or near it (empty, too long, a quote or LF in it)
    texts.map(lambda t: PREFIX + t + b'"}],"finish_reason":"stop"}\n\n'),  # another suffix
    texts.map(lambda t: b"data: " + t + b"\n\n"),  # another event
    st.just(b"\n"),  # a blank line between events
    st.just(b"data: [DONE]\n\n"),
    st.sampled_from([PREFIX, PREFIX[:10], SUFFIX[:3]]),  # a piece: an event cut short
)


@settings(max_examples=600, deadline=None)
@given(st.lists(event, max_size=12), st.data(), st.booleans())
def test_both_scans_agree_with_the_definition(pieces: list[bytes], data: st.DataObject, rename: bool) -> None:
    buf = b"".join(pieces)
    stop = buf.rfind(b"\n\n") + 2  # as the relay calls it: up to the end of the last complete event
    if stop < 2:
        return
    pos = data.draw(st.integers(0, stop - 1))
    client = CLIENT if rename else None
    want = oracle(buf, pos, stop, client)
    for name, scan in SCANS:
        assert scan(buf, pos, stop, PREFIX, SUFFIX, client, MAX_TEXT) == want, name


@settings(max_examples=400, deadline=None)
@given(st.lists(event, max_size=8), st.data())
def test_both_event_ends_agree_with_find(pieces: list[bytes], data: st.DataObject) -> None:
    buf = b"".join(pieces)
    stop = data.draw(st.integers(0, len(buf)))
    pos = data.draw(st.integers(0, stop))
    want = buf[:stop].find(b"\n\n", pos)
    assert sse_scan.reference_end(buf, pos, stop) == want
    assert sse_scan.event_end(buf, pos, stop) == want


@pytest.mark.parametrize(("name", "scan"), SCANS)
def test_a_run_of_ordinary_events_is_passed_and_renamed(name: str, scan: object) -> None:
    assert callable(scan)
    tok = PREFIX + b"hi" + SUFFIX
    other = b'data: {"usage":{}}\n\n'
    buf = tok + b"\n" + tok * 40 + other + tok  # more events than the C code's first buffer holds (32)
    end, count, renamed = scan(buf, 0, len(buf), PREFIX, SUFFIX, CLIENT, MAX_TEXT)
    assert (end, count) == (len(tok) * 41 + 1, 41)
    assert renamed == (CLIENT + b"hi" + SUFFIX + b"\n" + (CLIENT + b"hi" + SUFFIX) * 40)
    assert scan(buf, 0, len(buf), PREFIX, SUFFIX, None, MAX_TEXT) == (end, 41, None)
    assert scan(buf, end, len(buf), PREFIX, SUFFIX, CLIENT, MAX_TEXT) == (end, 0, None)  # stops at `other`


def test_the_build_runs_the_c_scan_exactly_when_it_is_compiled() -> None:
    assert bool(build_check.compiled()) == sse_scan.NATIVE
    assert (sse_scan.ordinary_run is sse_scan.reference_run) == (not sse_scan.NATIVE)
    assert (sse_scan.event_end is sse_scan.reference_end) == (not sse_scan.NATIVE)
    if sse_scan.NATIVE:  # its arguments are checked, not trusted
        with pytest.raises(TypeError, match="must be bytes"):
            sse_scan.ordinary_run("text", 0, 4, PREFIX, SUFFIX, None, MAX_TEXT)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="pos <= stop"):
            sse_scan.ordinary_run(b"data", 3, 1, PREFIX, SUFFIX, None, MAX_TEXT)
        with pytest.raises(ValueError, match="pos <= stop"):
            sse_scan.event_end(b"data", 3, 1)
        assert "C: gateway.proxy._sse_scan" in build_check.describe()
