"""Routing-quality benchmark: every policy on the same seeded MoE workload over emulated vLLM fleets.

    python -m bench.routing [--quick] [--speed X] [--requests N]      (or `python -m bench routing ...`)

Scenarios (each on a FRESH fleet process and FRESH gateway process(es), see `routing_scenarios.py`):
multi-tenant shared prefixes at ~70% load for every policy plus the one-infinite-backend reference; the
same workload over fleets whose KV makes the working set 1x-4x one backend's cache; a hot tenant;
two gateways without shared state; a heterogeneous fleet under the `sla` policy; a 70/30 A/B split.
Writes `bench/results/routing.md` (+ `.json`) and `routing_*.png`; exits 1 when a target fails. The
emulators run `speed` times faster than the modelled hardware: client-measured wall times are
multiplied by `speed` and reported as simulated seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.cli import standalone
from bench.procs import ROOT
from bench.routing_client import Result, median, to_jsonable
from bench.routing_report import Target, markdown, plots
from bench.routing_scenarios import (
    Plan,
    Tick,
    ab_split,
    heterogeneous,
    hot_tenant,
    multi_tenant,
    two_gateways,
    working_set_sweep,
)

POLICIES = ["round_robin", "least_load", "prefix_affinity", "sla", "cost"]
RESULTS = ROOT / "bench" / "results"
SCENARIOS = ["multi-tenant", "working-set", "hot-tenant", "two-gateways", "heterogeneous", "ab"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a smaller working set and KV (< 3 min)")
    p.add_argument("--speed", type=float, default=None, help="emulator speed (simulated s per wall s)")
    p.add_argument("--requests", type=int, default=None, help="requests per multi-tenant run")
    p.add_argument("--repeats", type=int, default=1, help="repeat the multi-tenant policy runs (medians)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--sla-ttft-ms", type=float, default=1500.0, help="heterogeneous scenario target (simulated ms)")
    p.add_argument("--out", type=Path, default=RESULTS)


def make_plan(args: argparse.Namespace) -> Plan:
    if args.quick:
        # KV scaled to 1/4 of the profile's 500k tokens and the working set with it, so the cache
        # pressure matches the full run with 4x fewer requests.
        return Plan(quick=True, speed=args.speed or 3.0, requests=args.requests or 600, kv_tokens=125_000,
                    scale=0.25, two_gateway_prefixes=100, ab_sessions=1000, hetero_requests=300, hot_requests=400,
                    repeats=args.repeats)
    return Plan(quick=False, speed=args.speed or 2.0, requests=args.requests or 2400, kv_tokens=None, scale=1.0,
                two_gateway_prefixes=200, ab_sessions=1500, hetero_requests=800, hot_requests=1600,
                repeats=args.repeats)


@contextmanager
def progress_bars(console: Console) -> Iterator[Any]:
    with Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as prog:

        def make(label: str, total: int) -> Tick:
            task = prog.add_task(label, total=total)

            def tick(_: Result) -> None:
                prog.advance(task)

            return tick

        yield make


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per policy: the median of each numeric field over repeats (first repeat for the rest)."""
    out = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        group = [r for r in rows if r["policy"] == policy]
        merged = dict(group[0])
        for k, v in group[0].items():
            if isinstance(v, float):
                merged[k] = median([float(g[k]) for g in group])
        out.append(merged)
    return out


def evaluate(res: dict[str, Any]) -> list[Target]:
    t: list[Target] = []
    mt = res.get("multi-tenant")
    if mt:
        rows = {r["policy"]: r for r in mt["table"]}
        pa, rr, ref = rows.get("prefix_affinity"), rows.get("round_robin"), mt["reference"]
        if pa and rr:
            share = pa["hit_rate"] / ref["hit_rate"]
            t.append(Target("multi-tenant: prefix_affinity engine hit rate >= 90% of one infinite backend",
                            f"{pa['hit_rate']:.1%} vs {ref['hit_rate']:.1%} = {share:.0%}", share >= 0.9))
            speedup = rr["ttft_p50_s"] / pa["ttft_p50_s"]
            # the TTFT of requests the engine serves from cache is a floor no routing goes below
            floor = pa.get("ttft_p50_cached90_s", math.nan)
            note = (f" (TTFT p50 of >= 90%-cached requests: {floor * 1000:.0f} ms, so about "
                    f"{rr['ttft_p50_s'] / floor:.2f}x is within reach of any routing here; see the working-set sweep)"
                    if floor == floor else "")
            t.append(Target("multi-tenant: TTFT p50 >= 2x better than round_robin",
                            f"{pa['ttft_p50_s'] * 1000:.0f} ms vs {rr['ttft_p50_s'] * 1000:.0f} ms = {speedup:.2f}x"
                            + note, speedup >= 2))
            worst = max(pa["inflight_max_mean"], pa["served_max_mean"])
            t.append(Target("multi-tenant: most loaded backend <= 1.5x mean (prefix_affinity)",
                            f"in-flight {pa['inflight_max_mean']:.2f}x, served {pa['served_max_mean']:.2f}x "
                            f"(per-sample p95 {pa['inflight_sample_p95']:.2f}x)", worst <= 1.5))
    ws = res.get("working-set")
    if ws:  # the regime the 2x target is about: a working set no single backend's cache holds
        big = [p for p in ws["points"] if p["factor"] >= 3 and {"round_robin", "prefix_affinity"} <= set(p["rows"])]
        ratios = [(p["factor"], p["rows"]["round_robin"]["ttft_p50_s"] / p["rows"]["prefix_affinity"]["ttft_p50_s"])
                  for p in big]
        if ratios:
            t.append(Target("multi-tenant, working set >= 3x one backend's KV (sweep): TTFT p50 >= 2x better than "
                            "round_robin", ", ".join(f"{f:g}x working set: {r:.2f}x" for f, r in ratios),
                            all(r >= 2 for _, r in ratios)))
    hot = res.get("hot-tenant")
    if hot:
        rows = {r["policy"]: r for r in hot["rows"]}
        pa, rr = rows["prefix_affinity"], rows["round_robin"]
        worst = max(pa["inflight_max_mean"], pa["served_max_mean"])
        t.append(Target("hot tenant: no backend above 2x the mean load (prefix_affinity)",
                        f"in-flight {pa['inflight_max_mean']:.2f}x, served {pa['served_max_mean']:.2f}x "
                        f"(per-sample p95 {pa['inflight_sample_p95']:.2f}x)", worst <= 2))
        t.append(Target("hot tenant: TTFT p99 below round_robin's",
                        f"{pa['ttft_p99_s'] * 1000:.0f} ms vs {rr['ttft_p99_s'] * 1000:.0f} ms",
                        pa["ttft_p99_s"] < rr["ttft_p99_s"]))
    two = res.get("two-gateways")
    if two:
        t.append(Target("two gateways: a new prefix goes to the same backend >= 95%",
                        f"{two['same_backend']}/{two['prefixes']} = {two['share']:.1%} under load "
                        f"(idle: {two['idle_same']}/{two['idle_prefixes']})", two["share"] >= 0.95))
    het = res.get("heterogeneous")
    if het:
        att = het["row"]["sla_attainment"]
        t.append(Target("heterogeneous: >= 99% of feasible TTFT targets met (sla policy)",
                        f"{att:.1%} of {het['row']['sla_requests']} (after 50 warm-up requests: "
                        f"{het['attainment_after_warmup']:.1%})", att >= 0.99))
    ab = res.get("ab")
    if ab:
        t.append(Target("A/B 70/30: arm shares within 3 standard errors",
                        f"vllm {ab['vllm_share']:.1%} (z = {ab['z']:+.2f}, SE {ab['stderr']:.2%})", abs(ab["z"]) <= 3))
        t.append(Target("A/B: 100% stickiness",
                        f"{ab['sticky_sessions']}/{ab['answered_sessions']} sessions on one arm",
                        ab["sticky_sessions"] == ab["answered_sessions"] == ab["sessions"]))
    return t


async def run_all(plan: Plan, args: argparse.Namespace, tmp: Path, console: Console) -> dict[str, Any]:
    res: dict[str, Any] = {}
    wanted = args.scenarios.split(",")
    with progress_bars(console) as bars:
        if "multi-tenant" in wanted:
            mt = await multi_tenant(plan, tmp, bars, args.policies.split(","))
            mt["table"] = median_rows(mt["rows"])
            res["multi-tenant"] = mt
        if "working-set" in wanted:
            res["working-set"] = await working_set_sweep(plan, tmp, bars, res.get("multi-tenant"))
        if "hot-tenant" in wanted:
            res["hot-tenant"] = await hot_tenant(plan, tmp, bars)
        if "two-gateways" in wanted:
            res["two-gateways"] = await two_gateways(plan, tmp, bars)
        if "heterogeneous" in wanted:
            res["heterogeneous"] = await heterogeneous(plan, tmp, bars, args.sla_ttft_ms)
        if "ab" in wanted:
            res["ab"] = await ab_split(plan, tmp, bars)
    return res


def run(args: argparse.Namespace, argv: list[str]) -> int:
    argv = argv[1:] if argv[:1] == ["routing"] else argv  # called as `python -m bench routing ...`
    console = Console()
    plan = make_plan(args)
    signal.signal(signal.SIGTERM, _interrupt)  # so every fleet and gateway process is stopped on the way out
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as d:
        try:
            import uvloop

            res = uvloop.run(run_all(plan, args, Path(d), console))
        except ImportError:
            res = asyncio.run(run_all(plan, args, Path(d), console))
    elapsed = time.monotonic() - t0
    targets = evaluate(res)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    stem = "routing_quick" if plan.quick else "routing"
    text = markdown(res, targets, plan=plan, argv=argv, rev=rev.strip(), elapsed_s=elapsed, stem=stem)
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_bytes(orjson.dumps(to_jsonable(_strip(res)), option=orjson.OPT_INDENT_2,
                                                         default=str))
    plots(res, args.out, stem)
    table = Table(title=f"routing targets ({elapsed:.0f} s)")
    for col in ("target", "measured", "result"):
        table.add_column(col)
    for tg in targets:
        table.add_row(tg.name, tg.measured, "[green]PASS" if tg.passed else "[red]FAIL")
    console.print(table)
    console.print(f"wrote {args.out / (stem + '.md')}")
    return 0 if all(tg.passed for tg in targets) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _strip(obj: Any) -> Any:
    """Drop the raw per-request TTFT lists from the JSON dump (they are in the plots)."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k != "ttfts_s"}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    if isinstance(obj, float) and math.isinf(obj):
        return None
    return obj


def main(argv: Sequence[str] | None = None) -> int:
    return standalone("python -m bench.routing", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
