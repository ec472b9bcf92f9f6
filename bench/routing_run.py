"""One measured run of the routing benchmark: a fresh emulated fleet, a fresh gateway, an open-loop
replay, load sampling and the engines' own counters, reduced to one row of numbers.

Every time the client measures is wall time; rows report simulated seconds (wall x speed), because
the emulators run `speed` times faster than the hardware they model.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench.procs import Proc
from bench.routing_client import Result, hit_counters, pct, replay, scrape
from bench.routing_fleet import BackendSpec
from bench.workload import TimedRequest

MODEL = "moe"
SAMPLE_EVERY_S = 0.1
TTFT_OBJECTIVE_S = 1.5  # simulated: the post-hoc SLA objective of the policy table


class Fleet:
    """`python -m bench.routing_fleet` with `specs`: every emulator of a run in one process."""

    def __init__(self, specs: Sequence[BackendSpec], tmp: Path, tag: str) -> None:
        self.specs = list(specs)
        arg = orjson.dumps([s.to_json() for s in specs]).decode()
        self.proc = Proc(f"fleet-{tag}", [sys.executable, "-m", "bench.routing_fleet", arg],
                         log=tmp / f"fleet-{tag}.log", stdout_pipe=True)
        line = self.proc.read_line("fleet ready ")
        self.urls: dict[str, str] = orjson.loads(line.removeprefix("fleet ready "))

    def stop(self) -> None:
        self.proc.stop()


class GatewayProc:
    """`python -m gateway serve --config FILE --port 0`, stopped by pid."""

    def __init__(self, config: Mapping[str, Any], tmp: Path, tag: str) -> None:
        path = tmp / f"gateway-{tag}.yaml"
        path.write_text(yaml.safe_dump(dict(config)))
        self.proc = Proc(f"gateway-{tag}", [sys.executable, "-m", "gateway", "serve", "--config", str(path),
                                            "--port", "0", "--log-level", "WARNING"],
                         log=tmp / f"gateway-{tag}.log", stdout_pipe=True)
        self.url = self.proc.read_line("gateway listening on ").split()[-1]

    def stop(self) -> None:
        self.proc.stop()


def gateway_config(fleet: Fleet, *, policy: str, usd_per_hour: float, route: Mapping[str, Any] | None = None,
                   backends: Sequence[str] | None = None) -> dict[str, Any]:
    names = list(backends or fleet.urls)
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"name": n, "runtime": next(s.runtime for s in fleet.specs if s.name == n), "url": fleet.urls[n],
                      "model": "moe-model", "usd_per_hour": usd_per_hour} for n in names],
        "routes": [dict(route) if route else {"model": MODEL, "backends": names, "policy": policy}],
        "health": {"interval_s": 0.5},
        "timeouts": {"first_token_s": 300, "total_s": 900},
    }


async def wait_ready(url: str, timeout_s: float = 30.0) -> None:
    """Until the gateway has scraped every backend once (block size and load known)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            async with http.get(url + "/admin/backends") as r:
                body = await r.json()
            if all(b["healthy"] and b["load"]["block_size"] for b in body["backends"]):
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"gateway {url} backends not ready")


async def sample_load(url: str, stop: asyncio.Event, out: list[dict[str, int]]) -> None:
    """Every 100 ms: the gateway's in-flight count per backend (from /admin/backends)."""
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url + "/admin/backends", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    body = await r.json()
                out.append({b["name"]: int(b["in_flight"]) for b in body["backends"]})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)


def wall_headers(requests: Sequence[TimedRequest], speed: float) -> list[TimedRequest]:
    """The workload's SLA targets are simulated ms; the gateway sees wall time, so divide by speed."""
    out = []
    for r in requests:
        if "x-sla-ttft-ms" in r.headers:
            h = dict(r.headers)
            h["x-sla-ttft-ms"] = f"{float(h['x-sla-ttft-ms']) / speed:.3f}"
            r = replace(r, headers=h)
        out.append(r)
    return out


@dataclass
class Run:
    """What one run measured (raw), before reduction."""

    results: list[Result]
    samples: list[dict[str, int]]
    counters: dict[str, tuple[float, float]]  # backend -> (hit tokens, queried tokens) deltas
    wall_s: float
    speed: float
    usd_per_hour: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)


async def measure(gateway_url: str | Sequence[str], fleet: Fleet, requests: Sequence[TimedRequest], *, speed: float,
                  usd_per_hour: float, on_done: Callable[[Result], None] | None = None,
                  background: Callable[[], Any] | None = None, sample_url: str | None = None) -> Run:
    """Replay `requests` open loop through the gateway(s), sampling load and the engines' counters."""
    async with aiohttp.ClientSession() as http:
        before = {n: hit_counters(await scrape(http, u + "/metrics")) for n, u in fleet.urls.items()}
    stop = asyncio.Event()
    samples: list[dict[str, int]] = []
    first = gateway_url if isinstance(gateway_url, str) else gateway_url[0]
    sampler = asyncio.create_task(sample_load(sample_url or first, stop, samples))
    bg = asyncio.create_task(background()) if background is not None else None
    t0 = time.perf_counter()
    results = await replay(gateway_url, wall_headers(requests, speed), speed=speed, model=MODEL, on_done=on_done)
    wall = time.perf_counter() - t0
    stop.set()
    await sampler
    if bg is not None:
        bg.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await bg
    async with aiohttp.ClientSession() as http:
        after = {n: hit_counters(await scrape(http, u + "/metrics")) for n, u in fleet.urls.items()}
    counters = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in fleet.urls}
    return Run(results, samples, counters, wall, speed, dict.fromkeys(fleet.urls, usd_per_hour))


def imbalance(samples: Sequence[Mapping[str, int]], names: Sequence[str]) -> dict[str, float]:
    """Load imbalance from in-flight samples: max/mean over backends of the time-averaged in-flight count,
    and the 95th percentile over samples (with at least 2 requests in flight per backend on average)
    of the per-sample max/mean."""
    if not samples or not names:
        return {"inflight_max_mean": math.nan, "inflight_sample_p95": math.nan}
    avg = [sum(s.get(n, 0) for s in samples) / len(samples) for n in names]
    mean = sum(avg) / len(avg)
    ratios = []
    for s in samples:
        vals = [s.get(n, 0) for n in names]
        m = sum(vals) / len(vals)
        if m >= 2:
            ratios.append(max(vals) / m)
    return {"inflight_max_mean": max(avg) / mean if mean > 0 else math.nan,
            "inflight_sample_p95": pct(ratios, 95), "inflight_mean": mean}


def ttft_breakdown(ok: Sequence[Result], speed: float) -> dict[str, Any]:
    """Where TTFT comes from: requests the engine served (almost) wholly from cache vs the rest, and
    the gateway's route reasons (how often prefix affinity spilled to a non-holder)."""
    cached = [r for r in ok if r.prompt_tokens and r.cached_tokens >= 0.9 * r.prompt_tokens]
    rest = [r for r in ok if not (r.prompt_tokens and r.cached_tokens >= 0.9 * r.prompt_tokens)]
    reasons: dict[str, int] = {}
    for r in ok:
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
    return {
        "cached90_share": len(cached) / len(ok) if ok else math.nan,
        "ttft_p50_cached90_s": pct([r.ttft_s * speed for r in cached if r.ttft_s is not None], 50),
        "ttft_p50_rest_s": pct([r.ttft_s * speed for r in rest if r.ttft_s is not None], 50),
        "reasons": reasons,
    }


def reduce(run: Run, names: Sequence[str] | None = None) -> dict[str, Any]:
    """One row: hit rates, latency percentiles (simulated s), throughput, SLA, imbalance, cost."""
    sp = run.speed
    ok = [r for r in run.results if r.status == 200 and not r.error]
    names = list(names or run.counters)
    ttft = [r.ttft_s * sp for r in ok if r.ttft_s is not None]
    itl = [g * sp for r in ok for g in r.itls_s]
    hits = sum(run.counters[n][0] for n in names)
    queries = sum(run.counters[n][1] for n in names)
    out_tokens = sum(r.completion_tokens for r in ok)
    sim_s = run.wall_s * sp
    served = {n: sum(1 for r in ok if r.backend == n) for n in names}
    mean_served = sum(served.values()) / len(names) if names else math.nan
    with_sla = [r for r in run.results if r.sla_ttft_s is not None]
    met = [r for r in with_sla if r.status == 200 and r.ttft_s is not None and r.ttft_s <= r.sla_ttft_s]  # type: ignore[operator]
    usd = sum(run.usd_per_hour[n] for n in names) * sim_s / 3600
    lates = [r.late_s for r in run.results]
    return {
        "requests": len(run.results), "ok": len(ok), "errors": len(run.results) - len(ok),
        "error_samples": sorted({r.error or str(r.status) for r in run.results if r not in ok})[:3],
        "hit_rate": hits / queries if queries else math.nan,
        "usage_hit_rate": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
        "throughput_tok_s": out_tokens / sim_s if sim_s else math.nan,
        "throughput_rps": len(ok) / sim_s if sim_s else math.nan,
        "sla_attainment": len(met) / len(with_sla) if with_sla else math.nan, "sla_requests": len(with_sla),
        # the same objective for every policy, applied after the fact (no header: routing is unaffected)
        "ttft_within_objective": sum(1 for t in ttft if t <= TTFT_OBJECTIVE_S) / len(run.results)
        if run.results else math.nan,
        **imbalance(run.samples, names),
        "served_max_mean": max(served.values()) / mean_served if mean_served else math.nan,
        "served": served,
        "usd_per_1m_tokens": usd / out_tokens * 1e6 if out_tokens else math.nan,
        "sim_s": sim_s, "wall_s": run.wall_s, "client_late_p99_ms": pct(lates, 99) * 1000,
        "ttfts_s": ttft,
        "per_backend_hit_rate": {n: (run.counters[n][0] / run.counters[n][1] if run.counters[n][1] else math.nan)
                                 for n in names},
        **ttft_breakdown(ok, sp),
        **run.extra,
    }
