"""One measured point of `bench overhead`: wrk against one target, with the CPU every party spent.

CPU is read before and after the run from /proc: the target's whole process group (nanosecond
schedstat; the 10 ms-tick figure is kept beside it as a cross-check), the upstream's, wrk's own (from
wait4) and the whole machine's (/proc/stat), so that "others" (the rest of this shared machine) is
what remains. For streams, wrk stops mid-stream at the end of its run while the target has already
spent CPU on the streams it was relaying; counting those as whole responses would overstate the
cost per response by up to c/(responses) (10-20% for long dripping streams), so streamed responses
are counted as bytes received / bytes of one whole response instead.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httptools

from bench import procs, wrk
from bench.targets import Target

SETTLE_S = 0.25  # after wrk exits: the target closes the connections wrk dropped, still on its bill


@dataclass(frozen=True, slots=True)
class Probe:
    status: int
    wire_bytes: int  # the whole response as read from the socket, head included
    body: bytes  # de-chunked

    @property
    def events(self) -> int:
        """SSE `data:` events in the body, `[DONE]` included (0 for a JSON answer)."""
        return sum(1 for line in self.body.split(b"\n") if line.startswith(b"data:"))


class _Collect:
    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.done = False

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.done = True


def probe(url: str, body: bytes, *, timeout_s: float = 30.0) -> Probe:
    """One POST /v1/chat/completions over a raw keep-alive connection, as wrk sends it; returns the
    status, the bytes on the wire and the body."""
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    collect = _Collect()
    parser = httptools.HttpResponseParser(collect)
    wire = 0
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + timeout_s
        while not collect.done:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}: no whole answer in {timeout_s:g}s")
            data = sock.recv(65536)
            if not data:
                raise ConnectionError(f"{url}: connection closed after {wire} bytes")
            wire += len(data)
            parser.feed_data(data)
    return Probe(parser.get_status_code(), wire, b"".join(collect.body))


def check(target: Target, body: bytes, *, stream: bool) -> Probe:
    """The target answers 200 with a chat completion (a stream ending in [DONE] when `stream`)."""
    p = probe(target.url, body)
    if p.status != 200 or b'"model":' not in p.body:
        raise RuntimeError(f"{target.name} at {target.url}: unexpected answer {p.status} {p.body[:200]!r}")
    if stream and not p.body.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(f"{target.name} at {target.url}: stream did not end with [DONE]: {p.body[-200:]!r}")
    return p


def point(section: str, target: Target, upstream: Target, *, body: Path, script: Path, conns: int,
          duration_s: float, rnd: int, probe_: Probe, stream: bool) -> dict[str, Any]:
    """wrk -c`conns` for `duration_s` against `target`; one row of figures."""
    direct = target.name == "direct"
    cpu0, ticks0, reads0 = target.cpu(), target.cpu_ticks(), target.reads()
    up0, busy0, t0 = upstream.cpu(), procs.machine_busy_seconds(), time.monotonic()
    r = wrk.run(target.url + "/v1/chat/completions", body, script, connections=conns, duration_s=duration_s)
    time.sleep(SETTLE_S)
    cpu, ticks, reads1 = target.cpu() - cpu0, target.cpu_ticks() - ticks0, target.reads()
    up = upstream.cpu() - up0
    busy = procs.machine_busy_seconds() - busy0
    wall = time.monotonic() - t0
    responses = r.bytes / probe_.wire_bytes if stream else float(r.requests)
    events = probe_.events
    ours = cpu + r.wrk_cpu_s + (0.0 if direct else up)
    return {
        "section": section, "target": target.name, "round": rnd, "c": conns,
        "requests": r.requests, "responses": responses, "bytes": r.bytes, "response_bytes": probe_.wire_bytes,
        "errors": r.errors, "rps": r.rps, "p50_ms": r.p50_ms, "p90_ms": r.p90_ms, "p99_ms": r.p99_ms,
        "mean_ms": r.mean_ms, "wall_s": wall, "cpu_s": cpu, "cpu_ticks_s": ticks,
        "cpu_us_per_req": cpu / responses * 1e6 if responses else None,
        "req_per_cpu_s": responses / cpu if cpu > 0 else None,
        "events_per_response": events,
        "cpu_us_per_chunk": cpu / (responses * events) * 1e6 if responses and events else None,
        "reads_per_response": (reads1 - reads0) / responses if reads0 is not None and reads1 is not None
        and responses else None,
        "cpu_util": cpu / wall, "upstream_cpu_util": up / wall, "wrk_cpu_util": r.wrk_cpu_s / wall,
        "other_cpu_util": max(busy - ours, 0.0) / wall,  # everyone else on this shared machine
    }
