"""`python -m bench replicas`: a fleet of gateway replicas sharing one Redis.

Redis plus 3 replicas of `gateway serve --workers 2` each. What it measures:

1. **rate-limit budget**: a key limited to `--rpm` requests a minute, hammered through all three
   replicas at once, with Redis on this host, with Redis `--store-rtt-ms` (60) away (through the
   tests' latency proxy, `tests/replicas/latency_proxy.py`: a loopback TCP proxy delivering every
   byte half a round trip late each way), and with no store (each replica's own budget) -> requests
   granted against the configured budget over the time it took (burst + refill; target: within 5 %);
2. **weight propagation**: `PUT /admin/routes/ab/weights` on one replica, then the time until every
   other replica answers with the new weights (fresh connections, so any of their workers);
3. **new-prefix agreement**: prompts nobody sent before, each sent to all three replicas (policy
   `prefix_affinity`, three emulated vLLM backends, no store involved) -> the share placed on the
   same backend by all three;
4. **requests/s scaling** from 1 to 3 replicas (wrk, the same total connections spread over the
   replicas, against nginx serving a canned vLLM answer: an emulator would be the bottleneck);
5. **store overhead per request**: one replica with a rate-limited key, with the store near, with
   the store 60 ms away and without it (its limits then in the supervisor), and with no key at all,
   measured side by side in alternating runs: sequential latency p50 (the added admission latency:
   the far store's p50 against no key's; target: at most 1 ms) and CPU per request (gateway
   processes, and Redis) at saturation.

Everything shares this machine's cores (the gateways, Redis, nginx, the emulators and the load
generators), so absolute numbers are low and noisy; ratios within one run are what to read.
Writes bench/results/replicas.md and replicas.png.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.progress import Progress

from gateway.access.secrets import hash_key
from tests.replicas.latency_proxy import LatencyProxy

from . import wrk
from .procs import Nginx, Proc, cpu_seconds, free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
KEY = "sk-bench"  # limited (the budget phase)
FREE_KEY = "sk-bench-free"  # not limited (the placement phase)
BODY = b'{"model":"moe","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="short runs (a few minutes in all)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="workers per replica")
    parser.add_argument("--rpm", type=int, default=120,
                        help="the rate-limit phase's budget (below what the clients can send)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per load run")
    parser.add_argument("--runs", type=int, default=None, help="alternating runs per overhead variant")
    parser.add_argument("--store-rtt-ms", type=float, default=60.0, help="the far store's added round trip")
    parser.add_argument("--out", default=str(RESULTS / "replicas.md"))


# -- processes -----------------------------------------------------------------------------------------

class Redis:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.proc = Proc("redis", ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--daemonize", "no"], log=tmp / "redis.log")
        deadline = time.monotonic() + 15
        while not self.ping():
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ping(self) -> bool:
        import socket

        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(8).startswith(b"+PONG")
        return False

    def stop(self) -> None:
        self.proc.stop()


class Replica:
    """`gateway serve --workers N` with one config, stopped by its process group."""

    def __init__(self, name: str, config: dict[str, Any], tmp: Path, *, workers: int) -> None:
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.name = name
        self.proc = Proc(name, [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", "0",
                                "--workers", str(workers), "--log-level", "WARNING"], log=tmp / f"{name}.log",
                         stdout_pipe=True)
        self.url = self.proc.read_line("gateway listening on ").split()[3]

    def pids(self) -> list[int]:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [self.proc.pid, *(int(p) for p in children.read_text().split())]

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids())

    def stop(self) -> None:
        self.proc.stop()


def start_all(configs: Sequence[tuple[str, dict[str, Any]]], tmp: Path, workers: int) -> list[Replica]:
    with ThreadPoolExecutor(len(configs)) as pool:
        return list(pool.map(lambda nc: Replica(nc[0], nc[1], tmp, workers=workers), configs))


@contextlib.contextmanager
def running(replicas: list[Replica]) -> Iterator[list[Replica]]:
    try:
        yield replicas
    finally:
        for r in replicas:
            r.stop()


def emulator(tmp: Path, i: int) -> tuple[Proc, str]:
    proc = Proc(f"emu{i}", [sys.executable, "-m", "gateway", "emulate", "--runtime", "vllm", "--port", "0",
                            "--model", "tiny-moe", "--profile", "tiny", "--speed", "200"], log=tmp / f"emu{i}.log",
                stdout_pipe=True)
    line = proc.read_line("emulator ")
    return proc, line.split(" ready at ")[1].split()[0]


def key_entry(rpm: int) -> dict[str, Any]:
    return {"id": "bench", "key": hash_key(KEY), "requests_per_minute": rpm}


FREE_ENTRY = {"id": "free", "key": hash_key(FREE_KEY)}


# -- 1. the budget --------------------------------------------------------------------------------------

def hammer(urls: list[str], seconds: float, threads: int = 6) -> tuple[int, int, float]:
    """(granted, refused, elapsed s): `threads` keep-alive clients, each cycling over the replicas."""
    counts = {200: 0, 429: 0}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    started = time.monotonic()

    def client(offset: int) -> None:
        clients = [httpx.Client(timeout=30, headers={"Authorization": f"Bearer {KEY}"}) for _ in urls]
        try:
            for i in itertools.count(offset):
                if time.monotonic() > deadline:
                    return
                r = clients[i % len(urls)].post(urls[i % len(urls)] + "/v1/chat/completions", content=BODY,
                                                headers={"Content-Type": "application/json"})
                with lock:
                    counts[r.status_code] = counts.get(r.status_code, 0) + 1
        finally:
            for c in clients:
                c.close()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(client, range(threads)))
    return counts.get(200, 0), counts.get(429, 0), time.monotonic() - started


# -- 2. propagation -------------------------------------------------------------------------------------

def weights(url: str) -> dict[str, float]:
    with httpx.Client(timeout=10) as c:  # a fresh connection: any worker of that replica
        found: dict[str, float] = c.get(url + "/admin/routes/ab/weights").json()["weights"]
        return found


def propagation(replicas: list[Replica], changes: int) -> list[float]:
    times = []
    for n in range(changes):
        target = {"vllm": float(10 + n), "sglang": float(90 - n)}
        start = time.monotonic()
        with httpx.Client(timeout=30) as c:
            c.put(replicas[0].url + "/admin/routes/ab/weights", json={"weights": target}).raise_for_status()
        pending = [r.url for r in replicas[1:]]
        while pending:
            pending = [u for u in pending if weights(u) != target]
            if time.monotonic() - start > 30:
                raise RuntimeError("a weight change did not reach every replica in 30 s")
        times.append(time.monotonic() - start)
    return times


# -- 3. new-prefix agreement ----------------------------------------------------------------------------

def placement(replicas: list[Replica], prompts: int) -> tuple[int, int]:
    agree = 0
    clients = [httpx.Client(timeout=30, headers={"Authorization": f"Bearer {FREE_KEY}"}) for _ in replicas]
    try:
        for i in range(prompts):
            text = f"bench prompt {i:05d} " + "a shared system prompt of some length " * 6
            body = {"model": "moe", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
            chosen = {c.post(r.url + "/v1/chat/completions", json=body).headers["x-gateway-backend"]
                      for c, r in zip(clients, replicas, strict=True)}
            agree += len(chosen) == 1
    finally:
        for c in clients:
            c.close()
    return agree, prompts


# -- 4 and 5. throughput --------------------------------------------------------------------------------

def wrk_fleet(urls: list[str], tmp: Path, *, connections: int, seconds: float, auth: bool) -> list[wrk.WrkResult]:
    body = tmp / "body.json"
    body.write_bytes(BODY)
    script = tmp / ("post-auth.lua" if auth else "post.lua")
    lua = wrk.LUA
    if auth:
        header = 'wrk.headers["Content-Type"] = "application/json"'
        lua = lua.replace(header, f'{header}\nwrk.headers["Authorization"] = "Bearer {KEY}"')
    script.write_text(lua)
    per = max(connections // len(urls), 1)
    with ThreadPoolExecutor(len(urls)) as pool:
        return list(pool.map(lambda u: wrk.run(u + "/v1/chat/completions", body, script, connections=per,
                                               duration_s=seconds), urls))


def interleaved_p50_ms(targets: Sequence[tuple[str, bool]], n: int) -> list[float]:
    """Sequential latency p50 of each (url, with the key) target, one request to each in turn (so
    the machine's noise falls on all of them alike), over keep-alive connections."""
    clients = [httpx.Client(timeout=30, headers={"Content-Type": "application/json",
                                                 **({"Authorization": f"Bearer {KEY}"} if auth else {})})
               for _, auth in targets]
    samples: list[list[float]] = [[] for _ in targets]
    try:
        for _ in range(n):
            for (url, _), client, out in zip(targets, clients, samples, strict=True):
                t = time.perf_counter()
                r = client.post(url + "/v1/chat/completions", content=BODY)
                out.append((time.perf_counter() - t) * 1000)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
    finally:
        for c in clients:
            c.close()
    return [statistics.median(s) for s in samples]


# -- the run ----------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    quick = args.quick
    seconds = args.duration or (4.0 if quick else 10.0)
    runs = args.runs or (2 if quick else 4)
    n_rep, workers = args.replicas, args.workers
    tmp = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    console = Console()
    res: dict[str, Any] = {}
    redis = Redis(tmp)
    far = LatencyProxy(redis.port, rtt_ms=args.store_rtt_ms, log_path=tmp / "latency-proxy.log")
    nginx = Nginx(tmp)
    emus = [emulator(tmp, i) for i in range(3)]
    try:
        with Progress(console=console) as progress:
            task = progress.add_task("replicas", total=5)
            backends = [{"name": f"vllm-{i}", "runtime": "vllm", "url": url, "model": "tiny-moe"}
                        for i, (_, url) in enumerate(emus)]
            functional = {
                "backends": backends,
                "routes": [{"model": "moe", "backends": [b["name"] for b in backends], "policy": "prefix_affinity"},
                           {"model": "ab", "split": {"arms": [
                               {"name": "vllm", "weight": 50, "backends": ["vllm-0"]},
                               {"name": "sglang", "weight": 50, "backends": ["vllm-1"]}]}}],
                "health": {"interval_s": 1.0},
                "auth": {"api_keys": [key_entry(args.rpm), FREE_ENTRY]},
            }
            # 1. the budget, with the store near, 60 ms away, and without it (each replica then has its own)
            for store in ("shared", "far", "local"):
                def config(i: int, store: str = store) -> dict[str, Any]:
                    if store == "local":
                        return functional
                    return {**functional, "state": {"redis_url": redis.url if store == "shared" else far.url,
                                                    "key_prefix": f"budget-{store}", "replica_id": f"r{i}"}}

                fleet = [(f"r{i}-{store}", config(i)) for i in range(n_rep)]
                with running(start_all(fleet, tmp, workers)) as reps:
                    granted, refused, elapsed = hammer([r.url for r in reps], seconds + 2)
                    res[f"budget_{store}"] = {
                        "granted": granted, "refused": refused, "elapsed_s": elapsed,
                        "configured": args.rpm + args.rpm / 60 * elapsed}
                    if store == "shared":
                        # 2. propagation and 3. placement on the same fleet
                        res["propagation_s"] = propagation(reps, 5 if quick else 20)
                        progress.advance(task)
                        res["placement"] = placement(reps, 60 if quick else 300)
                        progress.advance(task)
            progress.advance(task)
            # 4. scaling from 1 to n replicas (no store, no key) against nginx
            upstream = {"name": "nginx-vllm", "runtime": "vllm", "url": nginx.json_url, "model": "tiny-moe"}
            plain = {"backends": [upstream], "routes": [{"model": "moe", "backends": ["nginx-vllm"]}],
                     "health": {"interval_s": 5}}
            scaling: dict[int, list[float]] = {}
            with running(start_all([(f"p{i}", plain) for i in range(n_rep)], tmp, workers)) as reps:
                for _ in range(runs):
                    for k in range(1, n_rep + 1):
                        results = wrk_fleet([r.url for r in reps[:k]], tmp, connections=48, seconds=seconds,
                                            auth=False)
                        if any(x.errors for x in results):
                            raise RuntimeError(f"wrk saw errors with {k} replicas")
                        scaling.setdefault(k, []).append(sum(x.rps for x in results))
            res["scaling"] = scaling
            progress.advance(task)
            # 5. what the store adds per request: one replica each way, alternating runs
            keyed = {**plain, "auth": {"api_keys": [key_entry(10_000_000)]}}
            variants = {"no key": (plain, False), "key, limits in the supervisor": (keyed, True),
                        "key, limits in Redis": ({**keyed, "state": {"redis_url": redis.url, "key_prefix": "cost",
                                                                       "replica_id": "cost"}}, True),
                        f"key, limits in Redis {args.store_rtt_ms:g} ms away": (
                            {**keyed, "state": {"redis_url": far.url, "key_prefix": "cost-far",
                                                "replica_id": "cost-far"}}, True)}
            overhead: dict[str, dict[str, list[float]]] = {v: {"p50_ms": [], "cpu_us": [], "rps": [], "redis_us": []}
                                                           for v in variants}
            with running(start_all([(f"o{i}", cfg) for i, (cfg, _) in enumerate(variants.values())], tmp,
                                   workers)) as reps:
                for _ in range(runs):
                    targets = [(rep.url, auth) for (_, auth), rep in zip(variants.values(), reps, strict=True)]
                    for name, p50 in zip(variants, interleaved_p50_ms(targets, 300 if quick else 1000), strict=True):
                        overhead[name]["p50_ms"].append(p50)
                    for (name, (_, auth)), rep in zip(variants.items(), reps, strict=True):
                        cpu0, redis0 = rep.cpu_seconds(), cpu_seconds(redis.proc.pid)
                        (result,) = wrk_fleet([rep.url], tmp, connections=32, seconds=seconds, auth=auth)
                        cpu1, redis1 = rep.cpu_seconds(), cpu_seconds(redis.proc.pid)
                        overhead[name]["cpu_us"].append((cpu1 - cpu0) / max(result.requests, 1) * 1e6)
                        overhead[name]["redis_us"].append((redis1 - redis0) / max(result.requests, 1) * 1e6)
                        overhead[name]["rps"].append(result.rps)
            res["overhead"] = overhead
            progress.advance(task)
    finally:
        for proc, _ in emus:
            proc.stop()
        nginx.stop()
        far.stop()
        redis.stop()
    report(res, args, argv)
    return 0


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(res: dict[str, Any], args: argparse.Namespace, argv: Sequence[str]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    out = Path(args.out)
    lines = [
        "# Replicas sharing one Redis (`python -m bench replicas`)", "",
        f"- command: `{' '.join(['python -m bench replicas', *argv[1:]])}`",
        f"- commit `{commit.strip()}`, {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, "
        f"{os.cpu_count()} cores shared by every process of the run (the gateways, Redis, nginx, emulators, "
        "wrk, the Python clients) and with other work on this machine: absolute figures are low and noisy, "
        "ratios within the run are what to read",
        f"- {args.replicas} replicas x {args.workers} workers; Redis {redis_version()}", "",
        "## Rate-limit budget", "",
        f"One key, {args.rpm} requests/minute (burst {args.rpm}, then {args.rpm / 60:g}/s), hammered through all "
        "replicas at once by 6 clients cycling over them. Each process (every worker of every replica) holds a "
        "lease on the key's bucket in Redis and admits from it; the far store is the same Redis behind the "
        f"tests' latency proxy (+{args.store_rtt_ms:g} ms a round trip).", "",
        "| limits | granted | refused | seconds | configured budget over that time | granted / configured |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, label in (("budget_shared", "shared (Redis on this host)"),
                       ("budget_far", f"shared (Redis {args.store_rtt_ms:g} ms away)"),
                       ("budget_local", "per replica (no store)")):
        b = res[key]
        lines.append(f"| {label} | {b['granted']:,} | {b['refused']:,} | {b['elapsed_s']:.1f} | "
                     f"{b['configured']:,.0f} | {b['granted'] / b['configured']:.3f} |")
    far_ratio = res["budget_far"]["granted"] / res["budget_far"]["configured"]
    lines += ["", f"With the store {args.store_rtt_ms:g} ms away the fleet was granted **{far_ratio:.3f}** of the "
                  f"configured budget (target: within 5 %, {'met' if abs(far_ratio - 1) <= 0.05 else 'NOT met'})."]
    if not res["budget_local"]["refused"]:
        lines += ["", f"Without the store nothing was refused: each replica had its own {args.rpm}, "
                      f"{args.replicas} x the budget, more than the clients could spend in the time."]
    prop = res["propagation_s"]
    agree, prompts = res["placement"]
    lines += [
        "", "## Weight change reaching every replica", "",
        f"`PUT` on one replica, then polling the others (fresh connections) until all answer the new weights; "
        f"{len(prop)} changes; replicas read the shared hash every 0.2 s (`state.sync_interval_s`).", "",
        f"- median **{_med(prop) * 1000:.0f} ms**, max {max(prop) * 1000:.0f} ms (includes the HTTP round trips)", "",
        "## New-prefix agreement (no store involved)", "",
        f"- {agree} of {prompts} new prompts placed on the same backend by all {args.replicas} replicas "
        f"(**{agree / prompts:.1%}**), `prefix_affinity` over 3 emulated vLLM backends (rendezvous hashing)", "",
        "## Requests/s from 1 to 3 replicas", "",
        "wrk, 48 connections in all spread over the replicas, non-streaming, nginx upstream; medians of "
        f"{len(res['scaling'][1])} runs.", "",
        "| replicas | req/s | vs 1 |", "|---:|---:|---:|",
    ]
    base = _med(res["scaling"][1])
    for k, rps in sorted(res["scaling"].items()):
        lines.append(f"| {k} | {_med(rps):,.0f} | {_med(rps) / base:.2f}x |")
    lines += ["", f"With {os.cpu_count()} cores for everything, more replicas cannot add cores: the ratio shows "
                  "what spreading the same load costs or gains here, not what separate hosts would give.", "",
              "## What the store adds per request", "",
              "One replica per variant (same config otherwise), in alternating runs: sequential latency p50 over "
              "keep-alive connections, one request to each variant in turn, then wrk -c32 on each in turn with the "
              "gateway's CPU (supervisor and workers) and Redis's CPU per request.", "",
              "| variant | latency p50 ms | gateway CPU µs/request | Redis CPU µs/request | req/s |",
              "|---|---:|---:|---:|---:|"]
    ov = res["overhead"]
    for name, v in ov.items():
        lines.append(f"| {name} | {_med(v['p50_ms']):.3f} | {_med(v['cpu_us']):.0f} | {_med(v['redis_us']):.1f} | "
                     f"{_med(v['rps']):,.0f} |")
    names = list(ov)
    free = _med(ov[names[0]]["p50_ms"])
    added_far = _med(ov[names[3]]["p50_ms"]) - free
    added_near = _med(ov[names[2]]["p50_ms"]) - free
    added_host = _med(ov[names[1]]["p50_ms"]) - free
    added_cpu = _med(ov[names[2]]["cpu_us"]) - _med(ov[names[1]]["cpu_us"])
    lines += ["", f"Added admission latency p50 against no key: **{added_far:+.3f} ms** with the store "
                  f"{args.store_rtt_ms:g} ms away (target: at most 1 ms, "
                  f"{'met' if added_far <= 1.0 else 'NOT met'}), {added_near:+.3f} ms with it on this host, "
                  f"{added_host:+.3f} ms with the limits in the supervisor. Admissions decide from the leases their "
                  "process holds; Redis (or the supervisor) is asked in the background, a few times a second per "
                  f"key, to renew them. The store adds {added_cpu:+.0f} µs of gateway CPU per rate-limited request "
                  "against the supervisor. Requests without a limited key never touch Redis."]
    out.write_text("\n".join(lines) + "\n")
    plot(res, out.with_suffix(".png"))
    print("\n".join(lines))


def redis_version() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        text = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, timeout=10).stdout
        return text.split(" v=")[1].split()[0] if " v=" in text else text.strip()
    return "unknown"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ks = sorted(res["scaling"])
    axes[0].bar([str(k) for k in ks], [_med(res["scaling"][k]) for k in ks], color="#58a6ff")
    axes[0].set(title="req/s by replicas (shared cores)", xlabel="replicas", ylabel="req/s")
    b = [res["budget_shared"], res["budget_far"], res["budget_local"]]
    axes[1].bar(["Redis here", "Redis 60 ms", "per replica"], [x["granted"] / x["configured"] for x in b],
                color=["#3fb950", "#2ea043", "#f0883e"])
    axes[1].axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes[1].axhspan(0.95, 1.05, color="#3fb950", alpha=0.15)
    axes[1].set(title="rate-limit budget granted / configured")
    ov = res["overhead"]
    free = _med(ov["no key"]["p50_ms"])
    labels = ["supervisor", "Redis here", "Redis 60 ms"]
    axes[2].bar(labels, [_med(v["p50_ms"]) - free for name, v in ov.items() if name != "no key"],
                color=["#58a6ff", "#bc8cff", "#8957e5"])
    axes[2].axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes[2].set(title="added admission latency p50 (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
