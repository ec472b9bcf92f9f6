"""`gateway serve --workers N` scaling: non-streaming wrk load through 1..N SO_REUSEPORT workers.

Same upstream and request as `bench overhead`'s a (nginx serving a canned vLLM response, issue 13's
1.2 KB chat body), wrk -t1 -c64, median of repeated runs per worker count; the ratio to one worker is
what to read on a shared machine, beside how busy the rest of it was (`others_cores`). `bench scale`
runs the same measurement (`scaling`) as its workers section.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import median
from typing import Any

import orjson
from rich.progress import Progress

from bench import chat_bodies, procs, wrk
from bench.procs import Gateway, Nginx
from bench.scale_stats import others_cpu

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WARMUP_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    parser.add_argument("--out", default=str(RESULTS / "workers.md"))


def wrk_runs(url: str, pgid: int, upstream: Nginx, tmp: Path, *, runs: int, duration_s: float,
             advance: Callable[[], None]) -> dict[str, Any]:
    """A warm-up, then `runs` wrk runs against `url`: req/s of each, the CPU µs per request of the
    target's process group, of nginx and of wrk (what bounds the req/s the shared cores can give,
    `ceiling`), and the cores the rest of the machine used meanwhile."""
    body = tmp / "chat.json"
    body.write_bytes(orjson.dumps(chat_bodies.chat()))
    script = wrk.write_script(tmp)
    target = url + "/v1/chat/completions"
    wrk.run(target, body, script, connections=64, duration_s=WARMUP_S)
    rps, others, errors = [], [], 0
    us: dict[str, list[float]] = {"target": [], "upstream": [], "wrk": []}
    for _ in range(runs):
        cpu0, up0, busy0, t0 = procs.group_cpu_seconds(pgid), upstream.cpu_seconds(), \
            procs.machine_busy_seconds(), time.monotonic()
        r = wrk.run(target, body, script, connections=64, duration_s=duration_s)
        spent = {"target": procs.group_cpu_seconds(pgid) - cpu0, "upstream": upstream.cpu_seconds() - up0,
                 "wrk": r.wrk_cpu_s}
        others.append(others_cpu(procs.machine_busy_seconds() - busy0, sum(spent.values()), time.monotonic() - t0))
        for name, seconds in spent.items():
            us[name].append(seconds / max(r.requests, 1) * 1e6)
        rps.append(r.rps)
        errors += r.errors
        advance()
    return {"rps": rps, "median_rps": median(rps), "others_cores": others, "errors": errors,
            "cpu_us_per_request": {name: median(v) for name, v in us.items()}}


def ceiling(row: dict[str, Any], cores: int) -> float | None:
    """The req/s `cores` can give at most with the CPU per request of `row` (the target's, nginx's and
    wrk's, all on the same cores): what N workers could reach if their CPU per request stayed as
    measured. One worker's own bound is one core: 1e6 / its µs per request."""
    cpu = row.get("cpu_us_per_request")
    if not cpu or not sum(cpu.values()):
        return None
    return float(cores * 1e6 / sum(cpu.values()))


def scaling(counts: Sequence[int], tmp: Path, *, runs: int, duration_s: float,
            advance: Callable[[], None]) -> list[dict[str, Any]]:
    """One gateway per worker count in `counts`, each measured by `wrk_runs`, in front of one nginx."""
    nginx = Nginx(tmp)
    rows = []
    try:
        for workers in counts:
            gw = Gateway(f"gateway-{workers}w", nginx.json_url, tmp, workers=workers)
            try:
                rows.append({"workers": workers, **wrk_runs(gw.url, gw.pid, nginx, tmp, runs=runs,
                                                            duration_s=duration_s, advance=advance)})
            finally:
                gw.stop()
    finally:
        nginx.stop()
    return rows


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="workers-"))
    counts = list(range(1, args.max_workers + 1))
    with Progress() as progress:
        task = progress.add_task("workers scaling", total=len(counts) * args.runs)
        rows = scaling(counts, tmp, runs=args.runs, duration_s=args.duration,
                       advance=lambda: progress.advance(task))
    base = rows[0]["median_rps"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    lines = [
        "# `gateway serve --workers N` scaling", "",
        f"- command: `python -m bench workers {' '.join(argv[1:])}`".rstrip(),
        f"- commit `{commit.strip()}`, {os.cpu_count()} cores shared with nginx and wrk; wrk -t1 -c64, "
        f"{args.runs} x {args.duration:g} s per point, medians; others: cores the rest of the machine used", "",
        "| workers | req/s (median) | runs | vs 1 worker | others (cores) |", "|---:|---:|---|---:|---|",
    ]
    lines += [f"| {r['workers']} | {r['median_rps']:,.0f} | {', '.join(f'{s:,.0f}' for s in r['rps'])} | "
              f"{r['median_rps'] / base:.2f}x | {', '.join(f'{o:.2f}' for o in r['others_cores'])} |" for r in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
