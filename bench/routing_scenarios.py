"""The routing benchmark's scenarios. Each starts its own fresh fleet and gateway process(es)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from backends.base import Runtime
from backends.emulator import PROFILES
from backends.emulator.profiles import EngineParams
from bench.routing_client import Result, stream_one
from bench.routing_fleet import BackendSpec
from bench.routing_run import MODEL, Fleet, GatewayProc, Run, gateway_config, measure, reduce, wait_ready
from bench.workload import TimedRequest, WorkloadSpec, generate, ideal_hit_rate, words, working_set_tokens

PROFILE = "deepseek-v3-8xh200"
RUNTIME = "vllm"
INFINITE_KV = 10**9  # tokens: the reference backend never evicts
# Working set / one backend's KV for the sweep: the same workload and load, each backend's KV cut so
# that the fleet's distinct prompt tokens fill 1x-4x of one backend's cache (4x: exactly the fleet's).
SWEEP_FACTORS = (1.0, 2.0, 3.0, 4.0)
SWEEP_POLICIES = ("round_robin", "prefix_affinity")


@dataclass(frozen=True, slots=True)
class Plan:
    quick: bool
    speed: float
    requests: int
    kv_tokens: int | None  # per backend; None = the profile's (500k tokens)
    scale: float  # working-set scale of the workload
    load: float = 0.7
    backends: int = 4
    two_gateway_prefixes: int = 200
    ab_sessions: int = 1000
    hetero_requests: int = 600
    hot_requests: int = 1200
    repeats: int = 1


Tick = Callable[[Result], None]
Progress = Callable[[str, int], Tick]  # (label, total) -> per-request callback


def usd_per_hour() -> float:
    return PROFILES[PROFILE].usd_per_hour


def params() -> EngineParams:
    return PROFILES[PROFILE].runtimes[Runtime(RUNTIME)]


def capacity_rps(requests: list[TimedRequest], backends: float) -> float:
    """Fleet capacity from the profile: every backend's prefill rate over the mean prompt (no reuse
    assumed: the load every policy would face if the cache did not help), plus the decode compute
    floor per output token. Prefill dominates: ~3k-token prompts vs ~30 output tokens."""
    p = params()
    prompt = sum(r.prompt_tokens for r in requests) / len(requests)
    out = sum(r.max_tokens for r in requests) / len(requests)
    per_request_s = prompt / p.prefill_tokens_per_s + out * p.decode_s_per_token
    return backends / per_request_s


def base_spec(plan: Plan, **kw: Any) -> WorkloadSpec:
    spec = WorkloadSpec(**{"seed": 11, "requests": plan.requests, "tenants": 160, "docs": 64, "active_sessions": 96,
                           **kw})
    return spec.scaled(plan.scale)


def at_load(spec: WorkloadSpec, plan: Plan, backends: float) -> tuple[WorkloadSpec, float]:
    """`spec` with its arrival rate set to `plan.load` x the fleet's capacity (computed from the profile
    and the workload's own prompt and output lengths)."""
    cap = capacity_rps(generate(replace(spec, requests=min(spec.requests, 2000))), backends)
    return replace(spec, rate_rps=plan.load * cap), cap


def fleet_specs(plan: Plan, n: int, prefix: str = "b", **kw: Any) -> list[BackendSpec]:
    return [BackendSpec(f"{prefix}{i}", PROFILE, RUNTIME, plan.speed, plan.kv_tokens, **kw) for i in range(n)]


async def policy_run(policy: str, specs: list[BackendSpec], requests: list[TimedRequest], plan: Plan, tmp: Path,
                     progress: Progress, label: str, *, speed: float | None = None) -> dict[str, Any]:
    fleet = Fleet(specs, tmp, label)
    gw: GatewayProc | None = None
    try:
        gw = GatewayProc(gateway_config(fleet, policy=policy, usd_per_hour=usd_per_hour()), tmp, label)
        await wait_ready(gw.url)
        run = await measure(gw.url, fleet, requests, speed=speed or plan.speed, usd_per_hour=usd_per_hour(),
                            on_done=progress(label, len(requests)))
        return {"policy": policy, **reduce(run)}
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()


async def multi_tenant(plan: Plan, tmp: Path, progress: Progress, policies: list[str]) -> dict[str, Any]:
    """Scenario 1 + the policy table: tenants, sessions and RAG over 4 backends at ~70% load, every
    policy, plus the reference: the whole workload on ONE backend with an infinite KV cache at the same
    per-backend load (arrivals slowed by the fleet size, speed raised by it: same wall time)."""
    spec, cap = at_load(base_spec(plan), plan, plan.backends)
    reqs = generate(spec)
    rows = []
    for rep in range(plan.repeats):
        for policy in policies:
            rows.append({**await policy_run(policy, fleet_specs(plan, plan.backends), reqs, plan, tmp, progress,
                                            f"mt-{policy}-{rep}"), "repeat": rep})
    ref = await reference_run(plan, reqs, tmp, progress)
    return {"spec": spec, "capacity_rps": cap, "rows": rows, "reference": ref, "ideal_hit_rate": ideal_hit_rate(reqs),
            "mean_prompt_tokens": sum(r.prompt_tokens for r in reqs) / len(reqs),
            "working_set_tokens": working_set_tokens(reqs)}


def profile_kv_tokens() -> int:
    p = params()
    return p.kv_blocks * p.block_size


async def reference_run(plan: Plan, reqs: list[TimedRequest], tmp: Path, progress: Progress) -> dict[str, Any]:
    """The whole workload on ONE backend with an infinite KV at the same per-backend load (arrivals
    slowed by the fleet size, speed raised by it: same wall time)."""
    n = plan.backends
    ref_reqs = [replace(r, at_s=r.at_s * n) for r in reqs]
    ref_spec = [BackendSpec("ref", PROFILE, RUNTIME, plan.speed * n, INFINITE_KV)]
    return await policy_run("round_robin", ref_spec, ref_reqs, plan, tmp, progress, "mt-reference",
                            speed=plan.speed * n)


async def working_set_sweep(plan: Plan, tmp: Path, progress: Progress, mt: dict[str, Any] | None) -> dict[str, Any]:
    """The multi-tenant workload, unchanged (same requests, same arrival rate), on fleets whose
    per-backend KV is the working set / 1, 2, 3, 4: where prefix affinity should matter is a working
    set larger than one backend's cache that still fits in the fleet's. The original configuration
    (the multi-tenant table) is added as one more point from that run when it ran."""
    spec, _ = at_load(base_spec(plan), plan, plan.backends)
    reqs = generate(spec)
    ws = working_set_tokens(reqs)
    points: list[dict[str, Any]] = []
    for f in SWEEP_FACTORS:
        kv = int(ws / f)
        rows = {}
        for policy in SWEEP_POLICIES:
            specs = [BackendSpec(f"b{i}", PROFILE, RUNTIME, plan.speed, kv) for i in range(plan.backends)]
            rows[policy] = await policy_run(policy, specs, reqs, plan, tmp, progress, f"ws{f:g}x-{policy}")
        points.append({"factor": f, "kv_tokens": kv, "original": False, "rows": rows})
    kv0 = plan.kv_tokens or profile_kv_tokens()
    if mt is not None:
        table = {r["policy"]: r for r in mt["table"]}
        if all(p in table for p in SWEEP_POLICIES):
            points.append({"factor": ws / kv0, "kv_tokens": kv0, "original": True,
                           "rows": {p: table[p] for p in SWEEP_POLICIES}})
    points.sort(key=lambda pt: pt["factor"])
    reference = mt["reference"] if mt is not None else await reference_run(plan, reqs, tmp, progress)
    return {"working_set_tokens": ws, "original_kv_tokens": kv0, "original_factor": ws / kv0, "points": points,
            "reference": reference, "ideal_hit_rate": ideal_hit_rate(reqs), "rate_rps": spec.rate_rps,
            "requests": len(reqs)}


async def hot_tenant(plan: Plan, tmp: Path, progress: Progress) -> dict[str, Any]:
    """Scenario 2: tenant 0 has half of the chat and session traffic."""
    spec, cap = at_load(replace(base_spec(plan, hot_share=0.5, seed=12), requests=plan.hot_requests), plan,
                        plan.backends)
    reqs = generate(spec)
    rows = [await policy_run(p, fleet_specs(plan, plan.backends), reqs, plan, tmp, progress, f"hot-{p}")
            for p in ("round_robin", "prefix_affinity")]
    return {"spec": spec, "capacity_rps": cap, "rows": rows}


async def two_gateways(plan: Plan, tmp: Path, progress: Progress) -> dict[str, Any]:
    """Scenario 3: two gateway processes, same config, no shared state, one fleet; every NEW prefix is
    sent once through A and once through B (at the same moment), under a Poisson stream of prefixes."""
    fleet = Fleet(fleet_specs(plan, plan.backends), tmp, "2gw")
    gws: list[GatewayProc] = []
    try:
        for tag in ("A", "B"):
            gws.append(GatewayProc(gateway_config(fleet, policy="prefix_affinity", usd_per_hour=usd_per_hour()),
                                   tmp, f"2gw-{tag}"))
        for g in gws:
            await wait_ready(g.url)
        rng = random.Random(5)
        n = plan.two_gateway_prefixes
        tick = progress("two-gateways", 2 * n)
        reqs = []
        t = 0.0
        for i in range(n):
            t += rng.expovariate(2.0)  # simulated seconds: ~2 new prefixes per second, each sent twice
            system = f"New prefix {i}." + words(rng, rng.randint(500, 2000))
            reqs.append(TimedRequest(t, ({"role": "system", "content": system},
                                         {"role": "user", "content": "Question:" + words(rng, 20)}), 8))
        # Idle first: one new prefix at a time, A then B, nothing else in flight (pure placement).
        idle_same = 0
        async with aiohttp.ClientSession() as http:
            for i in range(n // 2):
                req = TimedRequest(0.0, ({"role": "system", "content": f"Idle prefix {i}." + words(rng, 800)},
                                         {"role": "user", "content": "Question:" + words(rng, 20)}), 1)
                a = await stream_one(http, gws[0].url, req, i, model=MODEL)
                b = await stream_one(http, gws[1].url, req, i, model=MODEL)
                idle_same += bool(a.backend) and a.backend == b.backend
        pairs = [r for r in reqs for _ in range(2)]
        urls = [gws[0].url, gws[1].url]
        run = await measure(urls, fleet, pairs, speed=plan.speed, usd_per_hour=usd_per_hour(), on_done=tick)
        by_index = {r.index: r for r in run.results}
        same = sum(1 for i in range(n)
                   if by_index[2 * i].backend and by_index[2 * i].backend == by_index[2 * i + 1].backend)
        reasons: dict[str, int] = {}
        for r in run.results:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
        return {"prefixes": n, "same_backend": same, "share": same / n, "reasons": reasons,
                "idle_prefixes": n // 2, "idle_same": idle_same,
                "errors": sum(1 for r in run.results if r.error or r.status != 200)}
    finally:
        for g in gws:
            g.stop()
        fleet.stop()


async def heterogeneous(plan: Plan, tmp: Path, progress: Progress, ttft_target_ms: float) -> dict[str, Any]:
    """Scenario 4: two normal backends, one with 3x the iteration cost, one overloaded by background load
    sent directly to it; `sla` policy; every request carries a TTFT target the fast backends can meet."""
    specs = [*fleet_specs(plan, 2, "fast"),
             BackendSpec("slow3x", PROFILE, RUNTIME, plan.speed, plan.kv_tokens, slow=3.0),
             BackendSpec("busy", PROFILE, RUNTIME, plan.speed, plan.kv_tokens)]
    # usable capacity: the two fast backends plus a third of the slow one; load at 60% of it
    spec = replace(base_spec(plan, sla_ttft_ms=ttft_target_ms, seed=13), requests=plan.hetero_requests)
    spec, cap = at_load(spec, replace(plan, load=0.6), 2 + 1 / 3)
    reqs = generate(spec)
    fleet = Fleet(specs, tmp, "hetero")
    gw: GatewayProc | None = None
    try:
        gw = GatewayProc(gateway_config(fleet, policy="sla", usd_per_hour=usd_per_hour()), tmp, "hetero")
        await wait_ready(gw.url)
        busy_url = fleet.urls["busy"]
        p = params()
        bg_tokens = 4000
        bg_rate = 1.5 * p.prefill_tokens_per_s / bg_tokens  # 1.5x what its prefill can absorb: the queue grows

        async def background() -> None:
            rng = random.Random(99)
            tasks: set[asyncio.Task[Result]] = set()
            async with aiohttp.ClientSession() as http:
                i = 0
                while True:
                    await asyncio.sleep(rng.expovariate(bg_rate) / plan.speed)
                    req = TimedRequest(0.0, ({"role": "user", "content": f"bg {i}" + words(rng, bg_tokens)},), 1)
                    task = asyncio.create_task(stream_one(http, busy_url, req, i, model="moe-model"))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    i += 1

        run: Run = await measure(gw.url, fleet, reqs, speed=plan.speed, usd_per_hour=usd_per_hour(),
                                 on_done=progress("heterogeneous-sla", len(reqs)), background=background)
        row = reduce(run)
        warm = [r for r in run.results if r.index >= 50 and r.sla_ttft_s is not None]
        met_warm = [r for r in warm if r.status == 200 and r.ttft_s is not None and r.ttft_s <= r.sla_ttft_s]  # type: ignore[operator]
        fast_ttft = sorted(r.ttft_s * plan.speed for r in run.results if r.backend.startswith("fast") and r.ttft_s)
        return {"spec": spec, "capacity_rps": cap, "row": row, "target_ms": ttft_target_ms,
                "attainment_after_warmup": len(met_warm) / len(warm) if warm else float("nan"),
                "fast_ttft_p99_s": fast_ttft[int(0.99 * (len(fast_ttft) - 1))] if fast_ttft else float("nan"),
                "bg_rate_rps": bg_rate}
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()


async def ab_split(plan: Plan, tmp: Path, progress: Progress) -> dict[str, Any]:
    """Scenario 5: a 70/30 split route (vLLM arm / SGLang arm) over `ab_sessions` sessions, two requests
    per session, interleaved; shares vs weights and stickiness from `x-gateway-arm`."""
    specs = [BackendSpec("v", "tiny", "vllm", 20.0), BackendSpec("s", "tiny", "sglang", 20.0)]
    fleet = Fleet(specs, tmp, "ab")
    gw: GatewayProc | None = None
    try:
        route = {"model": MODEL, "policy": "least_load",
                 "split": {"arms": [{"name": "vllm", "weight": 70, "backends": ["v"]},
                                    {"name": "sglang", "weight": 30, "backends": ["s"]}]}}
        gw = GatewayProc(gateway_config(fleet, policy="least_load", usd_per_hour=1.0, route=route), tmp, "ab")
        await wait_ready(gw.url)
        n = plan.ab_sessions
        rng = random.Random(21)
        order = [s for s in range(n) for _ in range(2)]
        rng.shuffle(order)
        reqs = [TimedRequest(i * 0.005, ({"role": "user", "content": f"hello from session {s}"},), 2,
                             {"x-session-id": f"ab-{s}"}, "chat", "", f"ab-{s}") for i, s in enumerate(order)]
        run = await measure(gw.url, fleet, reqs, speed=1.0, usd_per_hour=1.0, on_done=progress("ab-split", len(reqs)))
        arms: dict[str, set[str]] = {}
        for r in run.results:
            if r.status == 200 and r.arm:
                arms.setdefault(r.session or "", set()).add(r.arm)
        sticky = sum(1 for a in arms.values() if len(a) == 1)
        first = [next(iter(a)) for a in arms.values() if len(a) == 1]
        share = first.count("vllm") / len(first) if first else float("nan")
        se = (0.7 * 0.3 / max(1, len(first))) ** 0.5
        return {"sessions": n, "answered_sessions": len(arms), "sticky_sessions": sticky, "vllm_share": share,
                "stderr": se, "z": (share - 0.7) / se, "errors": sum(1 for r in run.results if r.status != 200)}
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()
