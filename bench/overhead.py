"""`python -m bench overhead [--quick] [--peers]`: what the gateway costs over a direct call.

Against a cheap upstream (nginx on loopback serving canned vLLM answers) we compare targets side by
side in every repetition: **direct** (nginx itself), **gateway** (`python -m gateway serve`, one vLLM
backend, as `make install` builds it), **pure** (the same sources without the modules `make native`
compiles), **naive** (bench/naive_proxy.py, a bare aiohttp reverse proxy) and **lean**
(bench/lean_proxy.py, the gateway's HTTP layers without its logic). Measured: closed-loop
throughput and latency with wrk at fixed concurrency, the target's CPU time per request (from
/proc/<pid>/stat), open-loop latency at fixed rates, streaming CPU per relayed chunk, added time to
first token, 10,000 concurrent slow streams through one gateway worker, and a py-spy profile.
Results: bench/results/overhead.md (+ .json, PNG plots, profile.md, profile-overhead.svg).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from bench import procs, profiling, report, wrk
from bench.procs import Gateway, Nginx, PyServer

RESULTS = Path(__file__).resolve().parent / "results"
CHAT_BODY = {"model": "moe", "messages": [{"role": "user", "content": "What is a good book about the sea?"}],
             "max_tokens": 12, "temperature": 0}
STREAM_BODY = {**CHAT_BODY, "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
STREAM_EVENTS = 67  # role chunk + 64 token chunks + usage chunk + [DONE], all relayed (usage was asked for)


@dataclass(frozen=True, slots=True)
class Plan:
    runs: int
    duration_s: float
    concurrency: tuple[int, ...]
    stream_concurrency: int
    ttft_n: int
    openloop_fractions: tuple[float, ...]  # of the gateway's closed-loop peak
    openloop_s: float
    profile_s: int
    streams_n: int
    streams_events: int
    streams_ramp_s: float


FULL = Plan(runs=3, duration_s=10, concurrency=(1, 8, 64, 256), stream_concurrency=32, ttft_n=500,
            openloop_fractions=(0.25, 0.5), openloop_s=10, profile_s=10, streams_n=10_000, streams_events=30,
            streams_ramp_s=10)
QUICK = Plan(runs=1, duration_s=2, concurrency=(1, 8, 64, 256), stream_concurrency=32, ttft_n=50,
             openloop_fractions=(0.5,), openloop_s=3, profile_s=3, streams_n=1000, streams_events=5,
             streams_ramp_s=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a ~1 minute smoke run (1 short run per point)")
    parser.add_argument("--peers", action="store_true",
                        help="also measure sglang-router, vllm-router and the LiteLLM proxy (installed into "
                             "~/.cache/igw/peers/; skipped with a note when an install fails)")
    parser.add_argument("--runs", type=int, help="repetitions per point (default 3, quick 1)")
    parser.add_argument("--duration", type=float, help="seconds per wrk run (default 10, quick 2)")
    parser.add_argument("--streams", type=int, help="concurrent slow streams (default 10000, quick 1000)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument("--only-streams", action="store_true",
                        help="only (re)run the concurrent-streams test, updating OUT/overhead.json")
    parser.add_argument("--report-only", action="store_true",
                        help="only re-render overhead.md, plots and profile.md from OUT/overhead.json")


@dataclass(slots=True)
class Target:
    name: str  # direct | gateway | naive | a peer's name
    url: str  # base URL
    cpu: Callable[[], float]  # CPU seconds of the process(es) doing the proxying (nginx for direct)


@dataclass(slots=True)
class Results:
    meta: dict[str, Any]
    closed: list[dict[str, Any]] = field(default_factory=list)  # one row per wrk run
    stream: list[dict[str, Any]] = field(default_factory=list)
    openloop: list[dict[str, Any]] = field(default_factory=list)
    ttft: dict[str, Any] = field(default_factory=dict)
    streams10k: dict[str, Any] = field(default_factory=dict)
    profiles: dict[str, str] = field(default_factory=dict)
    peers: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _sh(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, cwd=procs.ROOT).stdout.strip()
    except OSError:
        return ""


def source_digest() -> str:
    """sha256 over gateway/ and backends/ sources: names the exact code measured on a dirty tree."""
    h = hashlib.sha256()
    for path in sorted([*procs.ROOT.glob("gateway/**/*.py"), *procs.ROOT.glob("backends/**/*.py")]):
        h.update(str(path.relative_to(procs.ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _build() -> str:
    from gateway import build_check

    n = len(build_check.compiled())
    return f"native: {n} modules compiled by mypyc (`make native`)" if n else "pure Python (no `make native`)"


def machine_info(argv: list[str]) -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    import aiohttp

    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _sh("git", "rev-parse", "--short", "HEAD") + (" (dirty tree)" if _sh("git", "status", "--porcelain",
                                                                                       "gateway", "backends") else ""),
        "source_digest": source_digest(), "nproc": _sh("nproc"), "cpu": model, "build": _build(),
        "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
        "python": sys.version.split()[0], "aiohttp": aiohttp.__version__,
        "nginx": _sh("/usr/sbin/nginx", "-v") or subprocess.run([procs.NGINX, "-v"], capture_output=True,
                                                                text=True, check=False).stderr.strip(),
        "wrk": "wrk 4.1.0 (-t1)", "command": " ".join(["./.venv/bin/python", "-m", "bench", *argv]),
    }


def _check(url: str, body: dict[str, Any], *, stream: bool) -> None:
    """One request by hand: the target answers 200 with the client's model name (and [DONE] for streams)."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        data = resp.read()
    if stream and not data.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(f"{url}: stream did not end with [DONE]: {data[-200:]!r}")
    if b'"model":' not in data:
        raise RuntimeError(f"{url}: unexpected answer {data[:200]!r}")


def _wrk_point(target: Target, *, body: Path, script: Path, conns: int, duration_s: float,
               nginx: Nginx, rep: int) -> dict[str, Any]:
    cpu0, ngx0, busy0, t0 = target.cpu(), nginx.cpu_seconds(), procs.machine_busy_seconds(), time.monotonic()
    r = wrk.run(target.url + "/v1/chat/completions", body, script, connections=conns, duration_s=duration_s)
    wall = time.monotonic() - t0
    cpu = target.cpu() - cpu0
    ngx = nginx.cpu_seconds() - ngx0
    busy = procs.machine_busy_seconds() - busy0
    ours = cpu + r.wrk_cpu_s + (0.0 if target.name == "direct" else ngx)
    return {"target": target.name, "c": conns, "rep": rep, "rps": r.rps, "requests": r.requests,
            "errors": r.errors, "p50_ms": r.p50_ms, "p90_ms": r.p90_ms, "p99_ms": r.p99_ms, "mean_ms": r.mean_ms,
            "cpu_s": cpu, "cpu_us_per_req": cpu / r.requests * 1e6 if r.requests else None,
            "req_per_cpu_s": r.requests / cpu if cpu > 0 else None, "cpu_util": cpu / wall,
            "nginx_cpu_util": ngx / wall, "wrk_cpu_util": r.wrk_cpu_s / wall,
            "other_cpu_util": max(busy - ours, 0.0) / wall}  # everyone else on this shared machine


def _loadgen(*args: str, timeout_s: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.loadgen", *args], capture_output=True, text=True,
                         cwd=procs.ROOT, timeout=timeout_s, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"loadgen {args[0]} failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = orjson.loads(lines[-1])
    return result


@contextlib.contextmanager
def _progress() -> Iterator[Progress]:
    with Progress(TextColumn("{task.description:<44}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn()) as progress:
        yield progress


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.report_only:
        report.write(orjson.loads((args.out / "overhead.json").read_bytes()), args.out)
        return 0
    plan = QUICK if args.quick else FULL
    if args.streams:
        plan = Plan(**{**asdict(plan), "streams_n": args.streams})
    if args.only_streams:
        return _only_streams(plan, args.out, argv)
    if args.runs or args.duration:
        plan = Plan(**{**asdict(plan), "runs": args.runs or plan.runs, "duration_s": args.duration or plan.duration_s})
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "tmp" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    tmp.mkdir(parents=True)
    nofile = procs.raise_nofile(65536)
    res = Results(meta={**machine_info(argv), "plan": asdict(plan), "nofile": nofile})
    if 2 * plan.streams_n + 32 > nofile:
        res.notes.append(
            f"open-file limit is {nofile} (hard limit; raising it needs CAP_SYS_RESOURCE, which this machine "
            f"lacks): one gateway worker holding {plan.streams_n} streams needs {plan.streams_n} client + "
            f"{plan.streams_n} upstream sockets plus its own ~20 descriptors, so the last few streams may fail "
            "with EMFILE here; run with `--streams N` below the limit to see the gateway's own behaviour")
    started: list[Any] = []
    try:
        _run(plan, args, res, out, tmp, started)
    finally:
        for p in reversed(started):
            p.stop()
    res.meta["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    (out / "overhead.json").write_bytes(orjson.dumps(asdict(res), option=orjson.OPT_INDENT_2))
    report.write(asdict(res), out)
    print(f"results: {out / 'overhead.md'}")
    return 0


def _run(plan: Plan, args: argparse.Namespace, res: Results, out: Path, tmp: Path, started: list[Any]) -> None:
    chat_file, stream_file = tmp / "chat.json", tmp / "stream.json"
    chat_file.write_bytes(orjson.dumps(CHAT_BODY))
    stream_file.write_bytes(orjson.dumps(STREAM_BODY))
    script = wrk.write_script(tmp)

    nginx = Nginx(tmp)
    started.append(nginx)
    gw = Gateway("gateway", nginx.json_url, tmp)
    started.append(gw)
    gw_sse = Gateway("gateway-sse", nginx.sse_url, tmp)
    started.append(gw_sse)
    pure: list[Gateway] = []
    if (sources := procs.pure_sources(tmp)) is not None:  # the same gateway without `make native`
        pure = [Gateway(name, url, tmp, sources=sources)
                for name, url in (("pure", nginx.json_url), ("pure-sse", nginx.sse_url))]
        started.extend(pure)
    naive = PyServer("naive", "bench.naive_proxy", ["--upstream", nginx.json_url], tmp)
    started.append(naive)
    naive_sse = PyServer("naive-sse", "bench.naive_proxy", ["--upstream", nginx.sse_url], tmp)
    started.append(naive_sse)
    lean = PyServer("lean", "bench.lean_proxy", ["--upstream", nginx.json_url], tmp)
    started.append(lean)
    lean_sse = PyServer("lean-sse", "bench.lean_proxy", ["--upstream", nginx.sse_url], tmp)
    started.append(lean_sse)

    def cpu_of(pid: int) -> Callable[[], float]:
        return lambda: procs.cpu_seconds(pid)

    targets = [Target("direct", nginx.json_url, nginx.cpu_seconds), Target("gateway", gw.url, cpu_of(gw.pid)),
               Target("naive", naive.url, cpu_of(naive.pid)), Target("lean", lean.url, cpu_of(lean.pid))]
    stream_targets = [Target("direct", nginx.sse_url, nginx.cpu_seconds),
                      Target("gateway", gw_sse.url, cpu_of(gw_sse.pid)),
                      Target("naive", naive_sse.url, cpu_of(naive_sse.pid)),
                      Target("lean", lean_sse.url, cpu_of(lean_sse.pid))]
    if pure:
        targets.insert(2, Target("pure", pure[0].url, cpu_of(pure[0].pid)))
        stream_targets.insert(2, Target("pure", pure[1].url, cpu_of(pure[1].pid)))
    for t in targets:
        _check(t.url, CHAT_BODY, stream=False)
    for t in stream_targets:
        _check(t.url, STREAM_BODY, stream=True)

    n_closed = plan.runs * len(plan.concurrency) * len(targets)
    n_steps = (len(targets) * 2 + n_closed + plan.runs * len(stream_targets) + 1
               + plan.runs * len(plan.openloop_fractions) * len(targets) + 3 + 1)
    with _progress() as progress:
        task = progress.add_task("warm-up", total=n_steps)

        def step(description: str) -> None:
            progress.update(task, description=description)

        def done() -> None:
            progress.advance(task)

        for t, st in zip(targets, stream_targets, strict=True):
            step(f"warm-up {t.name}")
            wrk.run(t.url + "/v1/chat/completions", chat_file, script, connections=64, duration_s=2)
            done()
            wrk.run(st.url + "/v1/chat/completions", stream_file, script, connections=16, duration_s=1)
            done()

        # Closed loop, non-streaming: each repetition walks every concurrency, targets side by side.
        for rep in range(plan.runs):
            for c in plan.concurrency:
                for t in targets:
                    step(f"closed loop c={c} {t.name} (run {rep + 1}/{plan.runs})")
                    res.closed.append(_wrk_point(t, body=chat_file, script=script, conns=c,
                                                 duration_s=plan.duration_s, nginx=nginx, rep=rep))
                    done()

        for rep in range(plan.runs):
            for t in stream_targets:
                step(f"streaming c={plan.stream_concurrency} {t.name} (run {rep + 1}/{plan.runs})")
                row = _wrk_point(t, body=stream_file, script=script, conns=plan.stream_concurrency,
                                 duration_s=plan.duration_s, nginx=nginx, rep=rep)
                row["cpu_us_per_chunk"] = row["cpu_s"] / (row["requests"] * STREAM_EVENTS) * 1e6 \
                    if row["requests"] else None
                res.stream.append(row)
                done()

        step(f"TTFT x{plan.ttft_n}, sequential, interleaved")
        res.ttft = _loadgen("ttft", "--body", str(stream_file), "-n", str(plan.ttft_n),
                            *[a for t in stream_targets for a in ("--url", t.url + "/v1/chat/completions")],
                            timeout_s=600)
        res.ttft["names"] = {t.url + "/v1/chat/completions": t.name for t in stream_targets}
        done()

        peak = statistics.median(r["rps"] for r in res.closed if r["target"] == "gateway" and r["c"] == 64) \
            if 64 in plan.concurrency else 500.0
        for frac in plan.openloop_fractions:
            rate = max(50.0, round(peak * frac / 50) * 50)
            for rep in range(plan.runs):
                for t in targets:
                    step(f"open loop {rate:g} req/s {t.name} (run {rep + 1}/{plan.runs})")
                    cpu0 = t.cpu()
                    r = _loadgen("openloop", "--url", t.url + "/v1/chat/completions", "--body", str(chat_file),
                                 "--rate", str(rate), "--duration", str(plan.openloop_s),
                                 timeout_s=plan.openloop_s * 10 + 60)
                    res.openloop.append({"target": t.name, "rep": rep, "fraction": frac, **r,
                                         "cpu_us_per_req": (t.cpu() - cpu0) / max(r["ok"], 1) * 1e6})
                    done()

        _profile(plan, res, out, tmp, gw, gw_sse, chat_file, stream_file, script, step, done)
        step(f"{plan.streams_n} concurrent slow streams")
        res.streams10k = _streams(plan, tmp, stream_file, started)
        done()
    if args.peers:
        from bench import peers

        try:
            res.peers, notes = peers.measure(nginx=nginx, tmp=tmp, body=chat_file, script=script,
                                             plan_runs=plan.runs, duration_s=min(plan.duration_s, 5),
                                             gateway=targets[1], naive=next(t for t in targets if t.name == "naive"))
            res.notes.extend(notes)
        except Exception as exc:  # peers are optional: never lose the main results to them
            res.notes.append(f"peers failed: {type(exc).__name__}: {exc}")


def _profile(plan: Plan, res: Results, out: Path, tmp: Path, gw: Gateway, gw_sse: Gateway, chat_file: Path,
             stream_file: Path, script: Path, step: Callable[[str], None], done: Callable[[], None]) -> None:
    if profiling.py_spy() is None:
        res.notes.append("py-spy not installed (pip install -e '.[dev]'): no profile taken")
        for _ in range(3):
            done()
        return
    jobs = [("svg", gw, chat_file, out / "profile-overhead.svg", "flamegraph", 64),
            ("non-streaming", gw, chat_file, tmp / "profile-nonstream.txt", "raw", 64),
            ("streaming", gw_sse, stream_file, tmp / "profile-stream.txt", "raw", plan.stream_concurrency)]
    for name, g, body, path, fmt, conns in jobs:
        step(f"py-spy {name} ({plan.profile_s}s)")
        rec = profiling.record(g.pid, path, duration_s=plan.profile_s, fmt=fmt)
        time.sleep(0.5)
        wrk.run(g.url + "/v1/chat/completions", body, script, connections=conns, duration_s=plan.profile_s + 1)
        if rec is not None:
            _, err = rec.communicate(timeout=60)
            if rec.returncode != 0 or not path.exists():
                res.notes.append(f"py-spy {name} failed: {err.decode()[-300:]}")
            elif fmt == "raw":
                res.profiles[name] = profiling.markdown(
                    f"{name} (wrk -c{conns}, {plan.profile_s}s)", profiling.summarise(path))
        done()


def _only_streams(plan: Plan, out: Path, argv: list[str]) -> int:
    res: dict[str, Any] = orjson.loads((out / "overhead.json").read_bytes())
    tmp = out / "tmp" / dt.datetime.now().strftime("%Y%m%d-%H%M%S-streams")
    tmp.mkdir(parents=True)
    nofile = procs.raise_nofile(65536)
    stream_file = tmp / "stream.json"
    stream_file.write_bytes(orjson.dumps(STREAM_BODY))
    started: list[Any] = []
    try:
        result = _streams(plan, tmp, stream_file, started)
    finally:
        for p in reversed(started):
            p.stop()
    result["command"] = " ".join(["./.venv/bin/python", "-m", "bench", *argv])
    result["ramp_s"] = plan.streams_ramp_s
    res["streams10k"] = result
    res["meta"]["nofile"] = nofile
    (out / "overhead.json").write_bytes(orjson.dumps(res, option=orjson.OPT_INDENT_2))
    report.write(res, out)
    print(orjson.dumps(result).decode())
    return 0


def _streams(plan: Plan, tmp: Path, stream_file: Path, started: list[Any]) -> dict[str, Any]:
    slow = PyServer("slow-sse", "bench.slow_sse", ["--events", str(plan.streams_events), "--interval", "1"], tmp)
    started.append(slow)
    gw = Gateway("gateway-slow", slow.url, tmp)
    started.append(gw)
    try:
        _check(gw.url, {**STREAM_BODY}, stream=True)
        rss0, cpu0 = procs.rss_bytes(gw.pid), procs.cpu_seconds(gw.pid)
        client = subprocess.Popen(
            [sys.executable, "-m", "bench.loadgen", "streams", "--url", gw.url + "/v1/chat/completions",
             "--body", str(stream_file), "-n", str(plan.streams_n), "--ramp", str(plan.streams_ramp_s),
             "--timeout", str(plan.streams_events + 30)],
            cwd=procs.ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        peak, t0 = rss0, time.monotonic()
        while client.poll() is None:
            with contextlib.suppress(OSError):
                peak = max(peak, procs.rss_bytes(gw.pid))
            time.sleep(0.25)
        stdout = client.stdout.read() if client.stdout else ""
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        result: dict[str, Any] = orjson.loads(lines[-1]) if lines else {"error": "client printed nothing"}
        result.update(rss_before_mb=rss0 / 2**20, rss_peak_mb=peak / 2**20,
                      rss_after_mb=procs.rss_bytes(gw.pid) / 2**20,
                      kib_per_stream=(peak - rss0) / 1024 / max(plan.streams_n, 1),
                      gateway_cpu_s=procs.cpu_seconds(gw.pid) - cpu0, wall_s=time.monotonic() - t0,
                      events_per_stream=plan.streams_events, gateway_alive=gw.proc.proc.poll() is None)
        return result
    finally:
        gw.stop()
        slow.stop()
        started.remove(gw)
        started.remove(slow)
