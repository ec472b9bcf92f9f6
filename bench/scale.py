"""`python -m bench scale [--only idle,active,workers] [--no-peers] [--streams N]`: issue 26's scale
targets, with vllm-router beside the gateway where the measurement applies.

- **idle**: N streams held open through one gateway worker by an upstream that sends the role event
  and then nothing (bench/drip_sse.py with an hour between events), opened by bench/hold_streams.py
  in levels (N/4, N/2, N). The gateway's RSS before any stream and at each level's plateau; memory
  per stream is the slope of RSS over the levels (and the plain average at N). RSS is user-space
  memory only: the kernel's socket structures and buffers (struct sock, skbs) are slab memory no
  process's RSS counts, so the figure is what the gateway itself keeps per stream, its user-space
  transport objects included; the kernel's TCP buffer pages (/proc/net/sockstat, machine-wide) are
  reported beside it. Target: under 16 KiB. vllm-router under the same load, measured the same way.
- **active**: 2,000 streams, each sent one event every 1/rate s by the upstream (its own timer per
  stream, so the events are spread evenly over time), for each rate. The gateway's event-loop lag
  p50/p99 from the deltas of its own `gateway_event_loop_lag_seconds` histogram over the measured
  window (a 0.25 s timer: 4 observations a second), interpolated as PromQL's `histogram_quantile`,
  and the share of observations within 10 ms (the target: p99 under 10 ms). vllm-router exports no
  such metric (it runs on tokio's threads); for both, the gap between two reads of one stream as
  the client sees it, against the upstream's nominal gap, and the events per second delivered.
- **workers**: `--workers 1` and `--workers 2` non-streaming req/s against nginx (bench/workers.py's
  measurement: wrk -c64, median of runs), and their ratio (target: at least 1.8x on 2 cores).

The open-file limit bounds N: a proxy holds two sockets per stream (`scale_stats.max_streams`); with
a hard limit of 20,000 (no CAP_SYS_RESOURCE here) that is about 9,980, so N is cut to what fits and
the report says so. The lag and workers figures depend on what else the machine runs: every row
states the cores the rest of the machine used meanwhile; re-measure them on a quiet machine.
Results: bench/results/scale.md, .json, .png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from bench import chat_bodies, hold_streams, peers, procs, run_info, scale_report, scale_stats, workers
from bench.cli import progress_steps
from bench.procs import Gateway, PyServer

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("idle", "active", "workers")
IDLE_GAP_MS = 3_600_000  # an hour: after the role event the upstream says nothing
LAG = "gateway_event_loop_lag_seconds"


@dataclass(frozen=True, slots=True)
class Plan:
    sections: tuple[str, ...]
    peers: bool
    streams: int  # idle: the largest level (cut to what the open-file limit allows)
    idle_levels: tuple[float, ...]  # fractions of `streams`
    idle_ramp_per_s: float  # streams opened per second
    active_streams: int
    active_rates: tuple[float, ...]  # events per second per stream
    active_ramp_s: float
    active_settle_s: float
    active_window_s: float
    workers_runs: int
    workers_duration_s: float


FULL = Plan(sections=SECTIONS, peers=True, streams=10_000, idle_levels=(0.25, 0.5, 1.0), idle_ramp_per_s=500,
            active_streams=2000, active_rates=(1.0, 5.0, 10.0), active_ramp_s=10, active_settle_s=5,
            active_window_s=40, workers_runs=5, workers_duration_s=8)
QUICK = Plan(sections=SECTIONS, peers=True, streams=1000, idle_levels=(0.5, 1.0), idle_ramp_per_s=500,
             active_streams=200, active_rates=(5.0,), active_ramp_s=2, active_settle_s=2, active_window_s=5,
             workers_runs=1, workers_duration_s=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1,000 idle, 200 active, one short run each")
    parser.add_argument("--only", type=_sections, metavar="LIST", help=f"parts to run, of {','.join(SECTIONS)}")
    parser.add_argument("--no-peers", action="store_true", help=f"leave out {peers.VLLM_ROUTER.requirement}")
    parser.add_argument("--streams", type=int, help="idle: the most streams (default 10000, cut to the fd limit)")
    parser.add_argument("--active-streams", type=int, help="active: streams (default 2000)")
    parser.add_argument("--rates", type=_rates, help="active: events per second per stream, e.g. 1,5,10")
    parser.add_argument("--window", type=float, help="active: seconds measured per rate (default 40)")
    parser.add_argument("--runs", type=int, help="workers: wrk runs per worker count (default 5)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the results of the parts --only leaves out from OUT/scale.json")
    parser.add_argument("--report-only", action="store_true", help="re-render scale.md and .png from scale.json")


def _sections(value: str) -> tuple[str, ...]:
    chosen = {s.strip() for s in value.split(",") if s.strip()}
    if not chosen or chosen - set(SECTIONS):
        raise argparse.ArgumentTypeError(f"choose from {','.join(SECTIONS)}")
    return tuple(s for s in SECTIONS if s in chosen)


def _rates(value: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in value.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError("rates must be positive")
    return rates


def _plan(args: argparse.Namespace) -> Plan:
    p = QUICK if args.quick else FULL
    return Plan(sections=args.only or p.sections, peers=p.peers and not args.no_peers,
                streams=args.streams or p.streams, idle_levels=p.idle_levels, idle_ramp_per_s=p.idle_ramp_per_s,
                active_streams=args.active_streams or p.active_streams, active_rates=args.rates or p.active_rates,
                active_ramp_s=p.active_ramp_s, active_settle_s=p.active_settle_s,
                active_window_s=args.window or p.active_window_s, workers_runs=args.runs or p.workers_runs,
                workers_duration_s=p.workers_duration_s)


# -- the processes ------------------------------------------------------------------------------


@dataclass(slots=True)
class Proxy:
    """A target in front of one upstream: the gateway (one worker) or a peer."""

    name: str
    url: str
    pid: int
    stop: Callable[[], None]
    command: str = ""


def _start(name: str, upstream: str, tmp: Path, probe_body: bytes) -> Proxy:
    if name == "gateway":
        gw = Gateway("gateway-scale", upstream, tmp)
        proxy = Proxy("gateway", gw.url, gw.pid, gw.stop, "python -m gateway serve --config (one vLLM backend, "
                      "round_robin)")
    else:
        running = peers.start(peers.VLLM_ROUTER, upstream, tmp, name)
        proxy = Proxy(name, running.url, running.pid, running.stop, running.command)
    why = hold_streams.first_event(proxy.url, probe_body, timeout_s=120)
    if why is not None:
        proxy.stop()
        raise RuntimeError(f"{name} did not relay a stream: {why}")
    return proxy


def fd_count(pid: int) -> int:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return 0


def tcp_mem_pages() -> int:
    """Pages of TCP buffer memory the kernel holds for every socket of the machine (/proc/net/sockstat)."""
    for line in Path("/proc/net/sockstat").read_text().splitlines():
        if line.startswith("TCP:"):
            fields = line.split()
            return int(fields[fields.index("mem") + 1])
    return 0


class Client:
    """bench/hold_streams.py in its own process: `ready()`, then `mark()`, then `stop()`."""

    def __init__(self, url: str, body: Path, n: int, ramp_s: float, log: Path) -> None:
        self._err = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.hold_streams", "--url", url, "--body", str(body), "-n", str(n),
             "--ramp", f"{ramp_s:g}"], cwd=procs.ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._err, text=True)

    def _line(self, key: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            raise RuntimeError(f"hold_streams printed {line!r} (exit {self.proc.poll()})")
        got: dict[str, Any] = orjson.loads(line)[key]
        return got

    def ready(self) -> dict[str, Any]:
        return self._line("ready")

    def _say(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def mark(self) -> None:
        self._say("mark")

    def stop(self) -> dict[str, Any]:
        self._say("stop")
        result = self._line("result")
        self.proc.wait(60)
        self._err.close()
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._err.close()


def _body(tmp: Path, name: str, max_tokens: int) -> Path:
    path = tmp / f"{name}.json"
    path.write_bytes(orjson.dumps(chat_bodies.stream(max_tokens=max_tokens)))
    return path


def _wait_closed(pid: int, fds: int, *, timeout_s: float = 60.0) -> None:
    """Until the proxy has closed the streams' sockets (its descriptors back near `fds`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and fd_count(pid) > fds + scale_stats.FD_MARGIN:
        time.sleep(0.25)


def _plateau(pid: int, *, timeout_s: float = 20.0) -> tuple[int, list[int]]:
    """Samples RSS every 0.5 s until it has settled (or `timeout_s`); the last sample and them all."""
    samples = [procs.rss_bytes(pid)]
    deadline = time.monotonic() + timeout_s
    while not scale_stats.settled(samples) and time.monotonic() < deadline:
        time.sleep(0.5)
        samples.append(procs.rss_bytes(pid))
    return samples[-1], samples


# -- the sections --------------------------------------------------------------------------------


Step = Callable[[str], None]


def idle(plan: Plan, name: str, tmp: Path, nofile: int, step: Step, done: Callable[[], None]) -> dict[str, Any]:
    """Each level in a fresh proxy (and upstream): a proxy that keeps a stream whose client has gone
    until the upstream next writes (vllm-router does) would carry one level's streams into the next."""
    body = _body(tmp, "idle", 64)
    levels: list[dict[str, Any]] = []
    command, fds, n = "", 0, plan.streams
    for frac in plan.idle_levels:
        drip = PyServer(f"drip-idle-{name}", "bench.drip_sse", ["--gap-ms", str(IDLE_GAP_MS)], tmp)
        proxy = None
        try:
            proxy = _start(name, drip.url, tmp, body.read_bytes())
            command = proxy.command
            time.sleep(1.0)
            fds = fd_count(proxy.pid)
            n = min(plan.streams, scale_stats.max_streams(nofile, fds))
            k = max(1, round(n * frac))
            step(f"idle {name}: {k:,} streams")
            before, _ = _plateau(proxy.pid, timeout_s=5)
            tcp0 = tcp_mem_pages()
            client = Client(proxy.url, body, k, k / plan.idle_ramp_per_s, tmp / f"hold-idle-{name}-{k}.log")
            try:
                ready = client.ready()
                rss, samples = _plateau(proxy.pid)
                level: dict[str, Any] = {
                    "streams": k, "before_bytes": before, "rss_bytes": rss, "samples": samples, "ready": ready,
                    "fds": fd_count(proxy.pid), "tcp_mem_kib": (tcp_mem_pages() - tcp0) * procs.PAGE / 1024}
                level["result"] = client.stop()
            finally:
                client.kill()
            t0 = time.monotonic()
            _wait_closed(proxy.pid, fds, timeout_s=10)
            left = fd_count(proxy.pid) - fds
            level["released_s"] = time.monotonic() - t0 if left <= scale_stats.FD_MARGIN else None
            level["fds_left_after_reset"] = left
            levels.append(level)
        finally:
            if proxy is not None:
                proxy.stop()
            drip.stop()
        done()
    opened = [(lv["ready"]["first"], lv["rss_bytes"] - lv["before_bytes"]) for lv in levels if lv["ready"]["first"]]
    return {"target": name, "command": command, "nofile": nofile, "fds_before": fds, "streams_max": n,
            "levels": levels, **scale_stats.kib_per_stream(opened, 0)}


def _lag_buckets(url: str) -> scale_stats.Buckets | None:
    """The gateway's lag histogram now; None when /metrics did not answer in 30 s (a saturated loop)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            return scale_stats.histogram(resp.read().decode(), LAG)
    except OSError:  # URLError and socket timeouts are OSErrors
        return None


def active(plan: Plan, name: str, rate: float, tmp: Path, step: Step) -> dict[str, Any]:
    gap_ms = 1000 / rate
    tokens = math.ceil(rate * (plan.active_ramp_s + plan.active_settle_s + plan.active_window_s + 30))
    drip = PyServer(f"drip-{name}-{rate:g}", "bench.drip_sse", ["--gap-ms", f"{gap_ms:g}", "--max-tokens",
                                                                  str(tokens)], tmp)
    body = _body(tmp, f"active-{rate:g}", tokens)
    proxy = None
    try:
        proxy = _start(name, drip.url, tmp, body.read_bytes())
        step(f"active {name}: {plan.active_streams:,} streams x {rate:g} events/s")
        client = Client(proxy.url, body, plan.active_streams, plan.active_ramp_s, tmp / f"hold-{name}-{rate:g}.log")
        try:
            ready = client.ready()
            time.sleep(plan.active_settle_s)
            gateway = name == "gateway"
            lag0 = _lag_buckets(proxy.url) if gateway else {}
            cpu0, up0, cl0 = procs.group_cpu_seconds(proxy.pid), procs.group_cpu_seconds(drip.pid), \
                procs.cpu_seconds(client.proc.pid)
            busy0, t0 = procs.machine_busy_seconds(), time.monotonic()
            client.mark()
            time.sleep(plan.active_window_s)
            lag1 = _lag_buckets(proxy.url) if gateway else {}
            cpu, up = procs.group_cpu_seconds(proxy.pid) - cpu0, procs.group_cpu_seconds(drip.pid) - up0
            client_s = procs.cpu_seconds(client.proc.pid) - cl0
            busy, wall = procs.machine_busy_seconds() - busy0, time.monotonic() - t0
            result = client.stop()
        finally:
            client.kill()
        lag = scale_stats.delta(lag0, lag1) if lag0 is not None and lag1 is not None else {}
        scraped = not gateway or bool(lag)
        return {"target": name, "rate": rate, "streams": plan.active_streams, "ready": ready, "result": result,
                "cpu_cores": cpu / wall, "upstream_cores": up / wall, "client_cores": client_s / wall,
                "others_cores": scale_stats.others_cpu(busy, cpu + up + client_s, wall),
                "events_per_s": result["window_events"] / result["window_s"] if result["window_s"] else None,
                "expected_events_per_s": rate * plan.active_streams, "nominal_gap_ms": gap_ms,
                "lag_buckets": {str(k): v for k, v in lag.items()},
                "lag_p50_ms": _ms(scale_stats.quantile(0.5, lag)), "lag_p99_ms": _ms(scale_stats.quantile(0.99, lag)),
                "lag_within_10ms": scale_stats.share_at_most(0.01, lag), "lag_samples": lag.get(math.inf),
                "metrics_answered": scraped}
    finally:
        if proxy is not None:
            proxy.stop()
        drip.stop()


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None


def workers_section(plan: Plan, tmp: Path, names: list[str], step: Step,
                    done: Callable[[], None]) -> dict[str, Any]:
    step("workers: --workers 1 and 2, non-streaming")
    rows = workers.scaling((1, 2), tmp, runs=plan.workers_runs, duration_s=plan.workers_duration_s, advance=done)
    out: dict[str, Any] = {"rows": rows, "ratio": scale_stats.ratio_of_medians(rows[0]["rps"], rows[1]["rps"]),
                           "cores": os.cpu_count() or 1}
    if "vllm-router" in names:  # a reference: one multi-threaded process on the same 2 cores
        step("workers: vllm-router, the same load")
        nginx = procs.Nginx(tmp)
        try:
            running = peers.start(peers.VLLM_ROUTER, nginx.json_url, tmp, "vllm-router-json")
            try:
                why = peers.wait_ready(running, orjson.dumps(chat_bodies.chat()))
                if why is None:
                    out["vllm-router"] = workers.wrk_runs(running.url, running.pid, nginx, tmp,
                                                          runs=plan.workers_runs,
                                                          duration_s=plan.workers_duration_s, advance=done)
                else:
                    out["vllm-router_error"] = why
            finally:
                running.stop()
        finally:
            nginx.stop()
    return out


def run(args: argparse.Namespace, argv: list[str]) -> int:
    out: Path = args.out
    if args.report_only:
        scale_report.write(orjson.loads((out / "scale.json").read_bytes()), out)
        return 0
    plan = _plan(args)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "tmp" / dt.datetime.now().strftime("scale-%Y%m%d-%H%M%S")
    tmp.mkdir(parents=True)
    nofile = procs.raise_nofile(65536)
    res: dict[str, Any] = {"meta": {**run_info.machine_info(argv), "plan": asdict(plan), "nofile": nofile,
                                    "peers": {}},
                           "idle": [], "active": [], "workers": {}, "notes": []}
    names = ["gateway"]
    if plan.peers:
        why = peers.install(peers.VLLM_ROUTER)
        if why is None:
            names.append("vllm-router")
            res["meta"]["peers"]["vllm-router"] = peers.version(peers.VLLM_ROUTER)
        else:
            res["notes"].append(f"vllm-router left out: {why}")
    total = (len(plan.idle_levels) * len(names) * ("idle" in plan.sections)
             + len(plan.active_rates) * len(names) * ("active" in plan.sections)
             + plan.workers_runs * (len(names) + 1) * ("workers" in plan.sections))
    busy0, t0 = procs.machine_busy_seconds(), time.monotonic()
    with progress_steps(total) as (step, done):
        for name in names if "idle" in plan.sections else []:
            try:
                res["idle"].append(idle(plan, name, tmp, nofile, step, done))
            except RuntimeError as exc:
                res["notes"].append(f"idle {name}: {exc}")
            (tmp / "partial.json").write_bytes(orjson.dumps(res, option=orjson.OPT_INDENT_2))
        for rate in plan.active_rates if "active" in plan.sections else ():
            for name in names:
                try:
                    res["active"].append(active(plan, name, rate, tmp, step))
                except (RuntimeError, OSError) as exc:
                    res["notes"].append(f"active {name} at {rate:g}/s: {exc}")
                done()
            (tmp / "partial.json").write_bytes(orjson.dumps(res, option=orjson.OPT_INDENT_2))
        if "workers" in plan.sections:
            try:
                res["workers"] = workers_section(plan, tmp, names, step, done)
            except (RuntimeError, OSError) as exc:
                res["notes"].append(f"workers: {exc}")
    if args.keep and (out / "scale.json").exists():
        kept = orjson.loads((out / "scale.json").read_bytes())
        for section in SECTIONS:
            if section not in plan.sections and kept.get(section):
                res[section] = kept[section]
                res["notes"].append(f"{section}: kept from an earlier run ({kept['meta']['date']}, "
                                    f"`{kept['meta']['command']}`)")
    res["meta"]["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    res["meta"]["machine_cores_busy"] = (procs.machine_busy_seconds() - busy0) / (time.monotonic() - t0)
    res["meta"]["wall_s"] = time.monotonic() - t0
    (out / "scale.json").write_bytes(orjson.dumps(res, option=orjson.OPT_INDENT_2))
    text = scale_report.write(res, out)
    print(text)
    print(f"results: {out / 'scale.md'}")
    return 0
