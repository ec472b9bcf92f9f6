"""Soak: minutes of mixed load through a real gateway in front of emulators of every runtime, some
with fault knobs, sampling the gateway's RSS from /proc to show memory does not grow without bound.

`python -m bench soak --minutes 10` writes bench/results/soak.md (tables) and soak-rss.png. Reported:
requests served, faults the gateway saw (retries, backend 5xx, broken streams), client-visible errors
by cause, and RSS over time with its least-squares slope after the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.cli import standalone

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# (name, runtime, fault arguments): two clean backends, one shedding load, one failing outright.
FLEET: list[tuple[str, str, list[str]]] = [
    ("vllm-ok", "vllm", []),
    ("sglang-503", "sglang", ["--fail-rate", "0.1", "--fail-status", "503"]),
    ("trtllm-500", "trtllm", ["--fail-rate", "0.03", "--fail-status", "500"]),
    ("triton-ok", "triton", []),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling interval")
    parser.add_argument("--speed", type=float, default=20.0, help="emulator speed factor")
    parser.add_argument("--out", default=str(RESULTS / "soak.md"))
    parser.add_argument("--warmup-s", type=float, default=300.0,
                        help="exclude the first seconds from the slope (the live statistics' 1-s ring spans 300 s)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def slope_mib_per_hour(samples: list[tuple[float, float]]) -> float:
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    den = sum((t - mt) ** 2 for t, _ in samples)
    return 0.0 if den == 0 else sum((t - mt) * (r - mr) for t, r in samples) / den * 3600


@dataclass
class Tally:
    served: int = 0
    streamed: int = 0
    errors: Counter[str] = field(default_factory=Counter)


class Procs:
    """Child processes in their own sessions, stopped by pid."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True, text=True, **kwargs)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.1)


def start_fleet(procs: Procs, speed: float, workdir: Path) -> tuple[str, int]:
    backends = []
    for name, runtime, faults in FLEET:
        port = free_port()
        extra = []
        entry: dict[str, Any] = {"name": name, "runtime": runtime, "url": f"http://127.0.0.1:{port}",
                                 "model": "tiny-moe"}
        if runtime == "triton":
            mport = free_port()
            extra = ["--metrics-port", str(mport)]
            entry["metrics_url"] = f"http://127.0.0.1:{mport}"
        procs.start([sys.executable, "-m", "gateway", "emulate", "--runtime", runtime, "--port", str(port),
                     "--model", "tiny-moe", "--profile", "tiny", "--speed", str(speed), *extra, *faults],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        backends.append(entry)
    for b in backends:
        wait_http(str(b["url"]) + ("/v2/health/live" if b["runtime"] == "triton" else "/health"))
    config = {"backends": backends,
              "routes": [{"model": "moe", "backends": [b["name"] for b in backends], "policy": "least_load"}],
              "health": {"interval_s": 1, "failure_threshold": 5, "cooldown_s": 2}}
    path = workdir / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (workdir / "gateway.log").open("w")
    gw = procs.start([sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", "0"],
                     stdout=subprocess.PIPE, stderr=log)
    assert gw.stdout is not None
    line = gw.stdout.readline()
    if not line.startswith("gateway listening on "):
        raise RuntimeError(f"gateway did not start: {line!r}")
    return line.split()[-1], gw.pid


async def client_loop(client: httpx.AsyncClient, url: str, tally: Tally, stop_at: float, rng: random.Random) -> None:
    while time.monotonic() < stop_at:
        stream = rng.random() < 0.5
        body = {"model": "moe", "max_tokens": rng.randint(4, 48), "stream": stream,
                "messages": [{"role": "user", "content": f"soak {rng.randint(0, 50)} " + "x" * rng.randint(0, 400)}]}
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                raw = await resp.aread()
            if resp.status_code != 200:
                tally.errors[f"HTTP {resp.status_code}"] += 1
            elif stream and b'"error"' in raw:
                tally.errors["stream error event"] += 1
            elif stream and b"data: [DONE]" not in raw:
                tally.errors["stream without [DONE]"] += 1
            else:
                tally.served += 1
                tally.streamed += stream
        except httpx.HTTPError as exc:
            tally.errors[f"transport: {type(exc).__name__}"] += 1


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + value

    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gateway_retries_total":
                add("retries (503/429/reset/timeout, retried elsewhere)", s.value)
            elif s.name == "gateway_requests_total":
                status = s.labels.get("status", "")
                add("requests counted by the gateway", s.value)
                if status.startswith("5") and s.labels.get("backend") != "none":
                    add(f"backend answered {status} (not retryable)", s.value)
                if status == "stream_error":
                    add("broken streams", s.value)
            elif s.name == "gateway_backend_ejections_total":
                add("circuit-breaker ejections", s.value)
    return out


async def drive(url: str, pid: int, minutes: float, concurrency: int, sample_s: float) -> dict[str, Any]:
    tally = Tally()
    rss: list[tuple[float, float]] = []
    started = time.monotonic()
    stop_at = started + minutes * 60
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        clients = [asyncio.create_task(client_loop(client, url, tally, stop_at, random.Random(rng.random())))
                   for _ in range(concurrency)]
        while time.monotonic() < stop_at:
            rss.append((time.monotonic() - started, rss_mib(pid)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*clients)), sample_s)
        await asyncio.gather(*clients)
    rss.append((time.monotonic() - started, rss_mib(pid)))
    return {"tally": tally, "rss": rss, "wall_s": time.monotonic() - started}


def report(
    result: dict[str, Any], faults: dict[str, float], out: Path, minutes: float, concurrency: int, warmup_s: float
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tally: Tally = result["tally"]
    rss: list[tuple[float, float]] = result["rss"]
    warm = [s for s in rss if s[0] >= min(warmup_s, rss[-1][0] / 2)] or rss
    slope = slope_mib_per_hour(warm)
    png = out.with_name("soak-rss.png")
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([t / 60 for t, _ in rss], [r for _, r in rss], marker=".")
    ax.set_xlabel("minutes")
    ax.set_ylabel("gateway RSS (MiB)")
    ax.set_title(f"Soak: {minutes:g} min, {concurrency} clients; slope after warm-up {slope:+.2f} MiB/h")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    total = tally.served + sum(tally.errors.values())
    lines = [
        "# Soak",
        "",
        f"`python -m bench soak --minutes {minutes:g} --concurrency {concurrency}`: mixed streaming and",
        "non-streaming chat requests through one gateway process in front of four emulators "
        f"({', '.join(n for n, _, _ in FLEET)}; fault knobs: "
        + "; ".join(f"{n} {' '.join(f)}" for n, _, f in FLEET if f) + ").",
        "",
        "| what | value |",
        "|---|---|",
        f"| wall time | {result['wall_s'] / 60:.1f} min |",
        f"| requests sent | {total} |",
        f"| served (2xx, streams ending in [DONE]) | {tally.served} ({tally.streamed} streamed) |",
        f"| throughput | {total / result['wall_s']:.1f} req/s |",
        f"| every request counted once by the gateway | "
        f"{'yes' if faults.get('requests counted by the gateway') == total else 'NO'} |",
        *(f"| gateway: {k} | {v:.0f} |" for k, v in sorted(faults.items())),
        "",
        "Client-visible errors by cause:",
        "",
        "| cause | count | share |",
        "|---|---|---|",
        *(f"| {k} | {v} | {v / max(total, 1):.2%} |" for k, v in tally.errors.most_common()),
        *([] if tally.errors else ["| none | 0 | 0% |"]),
        "",
        "Gateway RSS (sampled from /proc/PID/status):",
        "",
        "| minute | RSS MiB |",
        "|---|---|",
        *(f"| {t / 60:.1f} | {r:.1f} |" for t, r in rss[:: max(1, len(rss) // 12)]),
        f"| {rss[-1][0] / 60:.1f} | {rss[-1][1]:.1f} |",
        "",
        f"Least-squares RSS slope after warm-up (from minute {warm[0][0] / 60:.1f}): **{slope:+.2f} MiB/hour** "
        f"(start {warm[0][1]:.1f} MiB, end {warm[-1][1]:.1f} MiB, max {max(r for _, r in rss):.1f} MiB).",
        "",
        "Expected shape: the live comparison (`gateway/stats/window.py`) keeps per-group rings of 300 1-s",
        "buckets and 60 1-min buckets with capped sample reservoirs, so RSS rises while the 1-s ring fills",
        "(first 5 minutes), then more slowly while the 1-min ring fills (first hour), then stays flat.",
        "A slope that does not fall after minute 5 would be a leak.",
        "",
        f"![RSS over time]({png.name})",
        "",
    ]
    text = "\n".join(lines)
    out.write_text(text)
    return text


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    procs = Procs()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        try:
            url, pid = start_fleet(procs, args.speed, Path(tmp))
            result = asyncio.run(drive(url, pid, args.minutes, args.concurrency, args.sample_s))
            faults = scrape(url)
        finally:
            procs.stop()
    print(report(result, faults, Path(args.out), args.minutes, args.concurrency, args.warmup_s))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return standalone("python -m bench.soak", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
