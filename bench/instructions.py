"""Instructions per request under callgrind: the gateway's own cost, in a unit that a shared, noisy
machine does not move. `python -m bench instructions [--requests N] [--gap-ms G]`

CPU seconds on this machine vary by up to 2x from round to round (`bench overhead` shows the rounds),
which hides a 10% change; the number of instructions a request executes does not vary. Each target
(the gateway as `python -m gateway serve`, and `bench/lean_proxy.py`, the same HTTP layers with no
logic) runs under `valgrind --tool=callgrind --instr-atstart=no`: after a warm-up, collection is
switched on (`callgrind_control -i on`), exactly N requests are sent one after the other on one
keep-alive connection, the counts are dumped, and the dump's total over N is the figure. Cases:

* json: nginx's canned chat completion (the `bench overhead` a load, one request at a time);
* sse: nginx's canned 20-event stream, sent in one write (b);
* drip: `bench/drip_sse.py` answering `max_tokens` token events, one write each, `--gap-ms` apart,
  at two lengths: (long - short) / the extra events is the cost of one more relayed chunk, and the
  gateway's minus the lean relay's is what the gateway's logic adds per chunk (c). The gap must
  be long enough for the target, slowed ~50x by valgrind, to read each event on its own (at 2 ms
  two events can share a read, and both targets look cheaper per chunk).

The drip figures still move a little with timing: the per-request work that follows a stream (its
gap histogram merged into the windows, throughput spread over the seconds it lasted) grows with how
much the gaps jittered, and a loaded machine jitters more (two runs: 3.4k and 4.6k instructions per
chunk beyond the lean relay, the second with a CI run beside it). Instructions are not time (a
memchr-based search does more per instruction than a Python-level loop), so this complements
`bench overhead`, it does not replace it. Needs `valgrind`; writes
OUT/instructions.md.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import yaml
from rich.progress import track

from bench import chat_bodies, procs, run_info

SHORT, LONG = 16, 80  # the drip case's two answer lengths (token events)
WARMUP = 30


def _request(body: dict[str, object]) -> bytes:
    data = orjson.dumps(body)
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def _ended(buf: bytes, streaming: bool) -> bool:
    """Whether `buf` holds one whole response (chunked for streams, Content-Length otherwise)."""
    if streaming:
        return buf.endswith(b"0\r\n\r\n")
    head, sep, rest = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(rest) >= int(value)
    return False


def _send(port: int, request: bytes, streaming: bool, count: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        for _ in range(count):
            s.sendall(request)
            buf = b""
            while not _ended(buf, streaming):
                chunk = s.recv(65536)
                if not chunk:
                    raise RuntimeError("the target closed the connection mid-response")
                buf += chunk
            if not buf.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the target answered {buf[:200]!r}")


def _argv(target: str, upstream: str, port: int, tmp: Path) -> list[str]:
    if target == "lean":
        return [sys.executable, "-m", "bench.lean_proxy", "--upstream", upstream, "--port", str(port)]
    config = procs.gateway_config(upstream)
    config["listen"]["port"] = port
    config["health"] = {"interval_s": 3600}  # no probe inside the counted window
    path = tmp / f"{target}-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--log-level", "WARNING"]


def instructions(target: str, upstream: str, request: bytes, streaming: bool, requests: int, tmp: Path) -> float:
    """Instructions per request of `target` ("gateway" or "lean") relaying `request` to `upstream`."""
    port = procs.free_port()
    out = tmp / f"callgrind-{target}-{port}.out"
    proc = procs.Proc(f"valgrind-{target}", ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                              f"--callgrind-out-file={out}", *_argv(target, upstream, port, tmp)],
                      log=tmp / f"valgrind-{target}-{port}.log", stdout_pipe=True)
    try:
        procs.wait_port(port, timeout_s=180)
        _send(port, request, streaming, WARMUP)
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        _send(port, request, streaming, requests)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        dump = next(iter(sorted(tmp.glob(f"{out.name}.*"))), None)
        if dump is None:
            raise RuntimeError(f"callgrind wrote no dump for {target}")
        totals = [line for line in dump.read_text().splitlines() if line.startswith("totals:")]
        return int(totals[-1].split()[1]) / requests
    finally:
        proc.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=200, help="requests counted per case and target (json, sse)")
    p.add_argument("--drip-requests", type=int, default=40, help="requests counted per drip length and target")
    p.add_argument("--gap-ms", type=float, default=10.0, help="drip: pause between two events of one stream")
    p.add_argument("--out", type=Path, default=procs.ROOT / "bench" / "results")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench instructions needs valgrind (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    tmp = args.out / "tmp" / time.strftime("instructions-%Y%m%d-%H%M%S")
    tmp.mkdir(parents=True)
    nginx = procs.Nginx(tmp)
    drip = procs.PyServer("drip", "bench.drip_sse", ["--port", "0", "--gap-ms", str(args.gap_ms),
                                                     "--max-tokens", str(LONG)], tmp)
    cases: list[tuple[str, str, bytes, bool, int]] = [
        ("json", nginx.json_url, _request(chat_bodies.chat()), False, args.requests),
        ("sse", nginx.sse_url, _request(chat_bodies.stream(max_tokens=18)), True, args.requests),
        *((f"drip-{t}", drip.url, _request(chat_bodies.stream(max_tokens=t)), True, args.drip_requests)
          for t in (SHORT, LONG)),
    ]
    plan = [(case, target) for case in cases for target in ("gateway", "lean")]
    got: dict[tuple[str, str], float] = {}
    try:
        for (case, upstream, request, streaming, requests), target in track(plan, description="callgrind"):
            got[case, target] = instructions(target, upstream, request, streaming, requests, tmp)
    finally:
        nginx.stop()
        drip.stop()
    per_chunk = {t: (got[f"drip-{LONG}", t] - got[f"drip-{SHORT}", t]) / (LONG - SHORT) for t in ("gateway", "lean")}
    report = _report(got, per_chunk, args, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "instructions.md").write_text(report)
    print(report)
    return 0


def _report(got: dict[tuple[str, str], float], per_chunk: dict[str, float], args: argparse.Namespace,
            argv: list[str]) -> str:
    info = run_info.machine_info(argv)
    lines = [
        "# Instructions per request (callgrind)",
        "",
        "Generated by `bench/instructions.py` (`python -m bench instructions`); do not edit by hand.",
        "",
        "| | |", "|---|---|",
        *(f"| {k} | {info[k]} |" for k in ("date", "commit", "source_digest", "cpu", "nproc", "build", "python",
                                            "command")),
        f"| counted | {args.requests} requests per case (json, sse), {args.drip_requests} per drip length, "
        f"after {WARMUP} warm-up requests; drip gap {args.gap_ms:g} ms |",
        "",
        "| case | gateway | lean byte relay | gateway − lean |",
        "|---|---:|---:|---:|",
    ]
    for case, label in [("json", "a: non-streaming"), ("sse", "b: 20 events in one write"),
                        (f"drip-{SHORT}", f"c: {SHORT} tokens, one event per write"),
                        (f"drip-{LONG}", f"c: {LONG} tokens, one event per write")]:
        g, lean = got[case, "gateway"], got[case, "lean"]
        lines.append(f"| {label} | {g:,.0f} | {lean:,.0f} | {g - lean:,.0f} |")
    g, lean = per_chunk["gateway"], per_chunk["lean"]
    lines += [f"| c: per additional chunk ({LONG} − {SHORT} tokens) / {LONG - SHORT} | {g:,.0f} | {lean:,.0f} | "
              f"**{g - lean:,.0f}** |", ""]
    return "\n".join(lines) + "\n"
