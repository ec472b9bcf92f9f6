"""Hold N streams open through a proxy and count what arrives, at a few instructions per read.

`bench scale` needs 10,000 concurrent streams from one client process on a 2-core machine that also
runs the proxy and its upstream; aiohttp's client costs tens of µs per event, so this is a bare
asyncio protocol on uvloop: one POST per connection, then every read is only counted (`Counter`):
`data:` events, `[DONE]`, and the gap between two reads that carried events.

Protocol with the parent (`bench/scale.py`), one JSON line each on stdout:
1. `{"ready": {...}}` once every stream has received its first event (or `--first-timeout` is up);
2. then the streams are held until a line arrives on stdin (or stdin closes), and the counts since
   the ready line are reset when it says `mark`: the active section measures a window;
3. `{"result": {...}}` after `stop`: every connection closed, the totals.
Progress goes to stderr as `{"progress": {"open": n, "first": n, "errors": n}}` once a second.

`python -m bench.hold_streams --url http://127.0.0.1:P --body FILE -n 10000 --ramp 20`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import sys
import time
from collections import Counter as Tally
from pathlib import Path
from typing import Any, cast

import orjson
import uvloop

from bench.loadgen import pct, ramp

_DATA = b"data:"
_DONE = b"data: [DONE]"


class Counter:
    """What one stream received: events (a `data:` field split over two reads still counts once),
    whether `[DONE]` came, and the time of the last read that carried an event."""

    __slots__ = ("_tail", "done", "events", "last_event_at", "status")

    def __init__(self) -> None:
        self.status = 0
        self.events = 0
        self.done = False
        self.last_event_at: float | None = None
        self._tail = b""  # the last bytes of the previous read, for a marker split across reads

    def feed(self, data: bytes, now: float) -> int:
        """Count `data`; returns how many events it completed the `data:` marker of."""
        if not self.status:
            line_end = data.find(b"\r\n")
            if data.startswith(b"HTTP/1.") and line_end > 0:
                self.status = int(data[9:12])
        joined = self._tail + data
        n = joined.count(_DATA) - self._tail.count(_DATA)
        if not self.done and _DONE in joined:
            self.done = True
        self._tail = joined[-(len(_DONE) - 1):]
        if n:
            self.events += n
            self.last_event_at = now
        return n


class HoldProtocol(asyncio.Protocol):
    def __init__(self, request: bytes, hold: Hold) -> None:
        self.request = request
        self.hold = hold
        self.counter = Counter()
        self.transport: asyncio.Transport | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        c = self.counter
        now = self.hold.loop.time()
        before, first = c.last_event_at, c.events == 0
        if c.feed(data, now):
            if first:
                self.hold.first += 1
                self.hold.progressed()
            elif before is not None and self.hold.measuring:
                self.hold.gaps.append(now - before)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.hold.stopping:
            self.hold.errors["closed by the server" if exc is None else type(exc).__name__] += 1
            self.hold.progressed()


class Hold:
    """The streams of one run; `gaps` holds the arrival gaps measured after `mark`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self.loop = loop
        self.n = n
        self.all_heard = asyncio.Event()  # every stream had its first event, or failed
        self.conns: list[HoldProtocol] = []
        self.first = 0
        self.errors: Tally[str] = Tally()
        self.gaps: list[float] = []
        self.measuring = False
        self.stopping = False

    def progressed(self) -> None:
        if self.first + sum(self.errors.values()) >= self.n:
            self.all_heard.set()

    def totals(self) -> dict[str, Any]:
        live = [c for c in self.conns if not c.lost]
        statuses = Tally(str(c.counter.status) for c in self.conns)
        return {"opened": len(self.conns), "open": len(live), "first": self.first,
                "events": sum(c.counter.events for c in self.conns), "done": sum(c.counter.done for c in self.conns),
                "statuses": dict(statuses), "errors": dict(self.errors)}


def request_bytes(host_port: str, body: bytes) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host_port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def first_event(url: str, body: bytes, *, timeout_s: float = 60.0) -> str | None:
    """Opens one stream and reads until its first event (polling while the proxy is not ready yet):
    None once one came with a 200, else the last reason it did not."""
    host_port = url.removeprefix("http://").rstrip("/")
    host, port = host_port.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        counter = Counter()
        try:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(request_bytes(host_port, body))
                while not counter.events:
                    data = sock.recv(65536)
                    if not data:
                        raise ConnectionError("closed before the first event")
                    counter.feed(data, 0.0)
            if counter.status == 200:
                return None
            last = f"status {counter.status}"
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    return last


async def run(url: str, body: bytes, n: int, ramp_s: float, first_timeout_s: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    host_port = url.removeprefix("http://").rstrip("/")
    host, port = host_port.rsplit(":", 1)
    request = request_bytes(host_port, body)
    hold = Hold(loop, n)

    async def progress() -> None:
        while True:
            await asyncio.sleep(1)
            t = hold.totals()
            print(orjson.dumps({"progress": {k: t[k] for k in ("opened", "open", "first", "events")}
                                | {"errors": sum(hold.errors.values())}}).decode(), file=sys.stderr, flush=True)

    async def one() -> None:
        try:
            _, proto = await loop.create_connection(lambda: HoldProtocol(request, hold), host, int(port))
            hold.conns.append(proto)
        except OSError as exc:
            hold.errors[f"connect: {type(exc).__name__}"] += 1
            hold.progressed()

    reporter = loop.create_task(progress())
    start = loop.time()
    await ramp(n, ramp_s, one)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(hold.all_heard.wait(), first_timeout_s)
    print(orjson.dumps({"ready": hold.totals() | {"ramp_elapsed_s": loop.time() - start}}).decode(), flush=True)

    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    marked_at, events_at_mark = loop.time(), 0
    while True:
        line = (await reader.readline()).strip()
        if line == b"mark":  # the measured window starts now
            hold.measuring, hold.gaps = True, []
            marked_at, events_at_mark = loop.time(), hold.totals()["events"]
            continue
        break
    window_s = loop.time() - marked_at
    totals = hold.totals()
    hold.stopping = True
    for c in hold.conns:  # with a reset: a FIN mid-stream could be a half-close, which a proxy must
        if c.transport is not None:  # not take for the client leaving until a write fails
            sock = c.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.transport.abort()
    reporter.cancel()
    gaps_ms = [g * 1e3 for g in hold.gaps]
    return totals | {"window_s": window_s, "window_events": totals["events"] - events_at_mark,
                     "gap_p50_ms": pct(gaps_ms, 50), "gap_p99_ms": pct(gaps_ms, 99), "gaps": len(gaps_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", type=Path, required=True)
    parser.add_argument("-n", type=int, default=10_000)
    parser.add_argument("--ramp", type=float, default=20.0, help="seconds over which the streams are opened")
    parser.add_argument("--first-timeout", type=float, default=60.0,
                        help="seconds after the ramp to wait for every stream's first event")
    args = parser.parse_args()
    result = uvloop.run(run(args.url, args.body.read_bytes(), args.n, args.ramp, args.first_timeout))
    print(orjson.dumps({"result": result}).decode(), flush=True)


if __name__ == "__main__":
    main()
