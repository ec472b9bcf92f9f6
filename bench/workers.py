"""`gateway serve --workers N` scaling: non-streaming wrk load through 1..N SO_REUSEPORT workers.

Same upstream as `bench overhead` (nginx serving a canned vLLM response), wrk -c64, median of
repeated runs per worker count; the ratio to one worker is what to read on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from statistics import median

import yaml
from rich.progress import Progress

from .procs import Nginx, free_port, gateway_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
POST = 'wrk.method="POST"\nwrk.headers["Content-Type"]="application/json"\n' \
       'wrk.body=\'{"model":"moe","messages":[{"role":"user","content":"hi"}],"max_tokens":8}\'\n'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    parser.add_argument("--out", default=str(RESULTS / "workers.md"))


def _wrk(url: str, script: Path, duration_s: float) -> float:
    out = subprocess.run(["wrk", "-t1", "-c64", f"-d{duration_s:g}s", "-s", str(script), url],
                         capture_output=True, text=True, check=True).stdout
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if match is None or "Non-2xx" in out:
        raise RuntimeError(f"wrk run failed or saw errors:\n{out}")
    return float(match.group(1))


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="workers-"))
    script = tmp / "post.lua"
    script.write_text(POST)
    nginx = Nginx(tmp)
    rows: list[tuple[int, float, list[float]]] = []
    try:
        with Progress() as progress:
            task = progress.add_task("workers scaling", total=args.max_workers * args.runs)
            for workers in range(1, args.max_workers + 1):
                cfg = gateway_config(nginx.json_url)
                cfg["listen"]["port"] = free_port()
                path = tmp / f"gateway-{workers}.yaml"
                path.write_text(yaml.safe_dump(cfg))
                proc = subprocess.Popen(
                    [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--workers", str(workers),
                     "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT,
                )
                try:
                    assert proc.stdout is not None
                    url = proc.stdout.readline().split()[3] + "/v1/chat/completions"
                    samples = []
                    for _ in range(args.runs):
                        samples.append(_wrk(url, script, args.duration))
                        progress.advance(task)
                    rows.append((workers, median(samples), samples))
                finally:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(30)
    finally:
        nginx.stop()
    base = rows[0][1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    lines = [
        "# `gateway serve --workers N` scaling", "",
        f"- command: `python -m bench workers {' '.join(argv[1:])}`".rstrip(),
        f"- commit `{commit.strip()}`, {os.cpu_count()} cores shared with nginx and wrk; wrk -t1 -c64, "
        f"{args.runs} x {args.duration:g} s per point, medians", "",
        "| workers | req/s (median) | runs | vs 1 worker |", "|---:|---:|---|---:|",
    ]
    lines += [f"| {w} | {m:,.0f} | {', '.join(f'{s:,.0f}' for s in ss)} | {m / base:.2f}x |" for w, m, ss in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
