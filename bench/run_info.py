"""What a benchmark report states about the run: the machine, the commit (and a digest of the sources,
which names the exact code measured on a dirty tree), the software and the command."""

from __future__ import annotations

import datetime as dt
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import chat_bodies, procs


def sh(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, cwd=procs.ROOT).stdout.strip()
    except OSError:
        return ""


def source_digest() -> str:
    """sha256 over gateway/, backends/ and bench/ sources: names the exact code measured on a dirty tree."""
    h = hashlib.sha256()
    files = [*procs.ROOT.glob("gateway/**/*.py"), *procs.ROOT.glob("backends/**/*.py"),
             *(p for p in procs.ROOT.glob("bench/**/*.py") if "results" not in p.parts)]
    for path in sorted(files):
        h.update(str(path.relative_to(procs.ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def build() -> str:
    from gateway import build_check

    n = len(build_check.compiled())
    return f"native: {n} modules compiled by mypyc (`make native`)" if n else "pure Python (no `make native`)"


def machine_info(argv: list[str]) -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    import aiohttp

    dirty = sh("git", "status", "--porcelain", "--", "gateway", "backends", "bench", ":!bench/results")
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": sh("git", "rev-parse", "--short", "HEAD") + (" (dirty tree)" if dirty else ""),
        "source_digest": source_digest(), "nproc": sh("nproc"), "cpu": model, "build": build(),
        "kernel": sh("uname", "-r"), "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
        "python": sys.version.split()[0], "aiohttp": aiohttp.__version__,
        "nginx": subprocess.run([procs.NGINX, "-v"], capture_output=True, text=True, check=False).stderr.strip(),
        "wrk": "wrk 4.1.0 (-t1)", "command": " ".join(["./.venv/bin/python", "-m", "bench", *argv]),
        "request_bytes": chat_bodies.size(chat_bodies.chat()),
        "system_prompt_bytes": len(chat_bodies.system_prompt()),
    }
