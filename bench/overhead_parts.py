"""The parts of `bench overhead` beyond the three targets that need more than wrk: the open loop and
time to first token (bench/loadgen.py, in its own process), py-spy profiles of the gateway under a,
b and c, and the concurrent slow streams through one gateway worker."""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from bench import measure, procs, profiling, wrk
from bench.procs import Gateway, PyServer
from bench.targets import Target

if TYPE_CHECKING:
    from bench.overhead import Plan, Results, Section


def loadgen(*args: str, timeout_s: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.loadgen", *args], capture_output=True, text=True,
                         cwd=procs.ROOT, timeout=timeout_s, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"loadgen {args[0]} failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = orjson.loads(lines[-1])
    return result


def openloop_targets(fams: dict[str, Section]) -> list[Target]:
    return [t for t in fams["json"].targets if t.name != "litellm"] if "json" in fams else []


def openloop(plan: Plan, res: Results, fams: dict[str, Section], step: Callable[[str], None],
              done: Callable[[], None]) -> None:
    gw_a = [r["rps"] for r in res.points if r["section"] == "a" and r["target"] == "gateway"]
    peak = statistics.median(gw_a) if gw_a else 500.0
    for frac in plan.openloop_fractions:
        rate = max(50.0, round(peak * frac / 50) * 50)
        for rnd in range(plan.rounds):
            for t in openloop_targets(fams):
                step(f"open loop {rate:g} req/s {t.name} (round {rnd + 1}/{plan.rounds})")
                cpu0 = t.cpu()
                r = loadgen("openloop", "--url", t.url + "/v1/chat/completions", "--body", str(fams["json"].body),
                             "--rate", str(rate), "--duration", str(plan.openloop_s),
                             timeout_s=plan.openloop_s * 10 + 60)
                res.openloop.append({"target": t.name, "round": rnd, "fraction": frac, **r,
                                     "cpu_us_per_req": (t.cpu() - cpu0) / max(r["ok"], 1) * 1e6})
                done()


def profile(plan: Plan, res: Results, out: Path, tmp: Path, fams: dict[str, Section], script: Path,
             step: Callable[[str], None], done: Callable[[], None]) -> None:
    if profiling.py_spy() is None:
        res.notes.append("py-spy not installed (pip install -e '.[dev]'): no profile taken")
        for _ in range(4):
            done()
        return
    jobs = [("svg", "json", out / "profile-overhead.svg", "flamegraph"),
            ("a: non-streaming", "json", tmp / "profile-nonstream.txt", "raw"),
            ("b: 20 events in one write", "sse", tmp / "profile-stream.txt", "raw"),
            ("c: one event per write", "drip", tmp / "profile-drip.txt", "raw")]
    for name, key, path, fmt in jobs:
        gw = fams[key].target("gateway")
        assert gw is not None
        step(f"py-spy {name} ({plan.profile_s}s)")
        rec = profiling.record(gw.pgid, path, duration_s=plan.profile_s, fmt=fmt)
        time.sleep(0.5)
        wrk.run(gw.url + "/v1/chat/completions", fams[key].body, script, connections=plan.concurrency,
                duration_s=plan.profile_s + 1)
        if rec is not None:
            _, err = rec.communicate(timeout=60)
            if rec.returncode != 0 or not path.exists():
                res.notes.append(f"py-spy {name} failed: {err.decode()[-300:]}")
            elif fmt == "raw":
                res.profiles[name] = profiling.markdown(
                    f"{name} (wrk -c{plan.concurrency}, {plan.profile_s}s)", profiling.summarise(path))
        done()


def streams(plan: Plan, tmp: Path, stream_file: Path, started: list[Any]) -> dict[str, Any]:
    slow = PyServer("slow-sse", "bench.slow_sse", ["--events", str(plan.streams_events), "--interval", "1"], tmp)
    started.append(slow)
    gw = Gateway("gateway-slow", slow.url, tmp)
    started.append(gw)
    try:
        measure.check(Target("gateway", gw.url, gw.pid), stream_file.read_bytes(), stream=True)
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
