"""The run of ordinary token events in an SSE read: the SSE relay's inner loop (`sse.SseRelay.feed`).

An ordinary token event is how a stream's token events begin (`prefix`, learned from its first one),
then 1 to `max_text` bytes of generated text that do not start with a quote, then how they end
(`suffix`, up to and including the blank line). `ordinary_run` passes blank lines and such events
from `pos` up to `stop` (the end of the read's complete events) and says where the first other event
starts, how many it passed and, when the model is renamed (`client`: the prefix as the client gets
it), the run with each event's prefix replaced.

Two implementations with the same rules: `reference_run` here, the reference and what the pure build
runs, and `_sse_scan.c`, a small C extension built with the compiled modules (`make native`). The C
one exists because this loop was the measured cost of a coalesced stream (20 events in one write):
compiled by mypyc, each ordinary event still cost ~2k instructions, mostly `bytes.find`'s argument
parsing and its byte-by-byte search for a two-byte pattern, where C does a memcmp, a memchr and a
memcmp (bench/results/instructions.md). `event_end`, where an event ends, is the same search alone
(`reference_end`: `bytes.find`). `NATIVE` says which one runs (`gateway serve` prints it).
"""

from __future__ import annotations


def reference_run(buf: bytes, pos: int, stop: int, prefix: bytes, suffix: bytes, client: bytes | None,
                  max_text: int) -> tuple[int, int, bytes | None]:
    """(where the first other event starts or `stop`, ordinary events passed, the run renamed or None)."""
    start, count = pos, 0
    plen, slen = len(prefix), len(suffix)
    starts: list[int] = []
    while True:
        while pos < stop and buf[pos] == 10:
            pos += 1
        body = pos + plen
        if body >= stop or buf[body] == 34 or buf[pos:body] != prefix:
            break
        nxt = buf.find(b"\n\n", body, min(body + max_text + slen, stop))
        tail = nxt + 2 - slen  # where an ordinary event's suffix starts
        if nxt < 0 or not body < tail <= body + max_text or buf[tail:nxt + 2] != suffix:
            break
        if client is not None:
            starts.append(pos)
        count += 1
        pos = nxt + 2
    if client is None or not count:
        return pos, count, None
    parts: list[bytes] = []
    copied = start
    for at in starts:
        parts += (buf[copied:at], client)
        copied = at + plen
    parts.append(buf[copied:pos])
    return pos, count, b"".join(parts)


def reference_end(buf: bytes, pos: int, stop: int) -> int:
    """Where the first blank line at or after `pos` starts (both its LFs before `stop`), or -1."""
    return buf.find(b"\n\n", pos, stop)


try:
    from ._sse_scan import event_end as event_end
    from ._sse_scan import ordinary_run as ordinary_run

    NATIVE = True
except ImportError:  # the pure build (no `make native`)
    ordinary_run = reference_run
    event_end = reference_end
    NATIVE = False
