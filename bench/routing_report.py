"""The routing benchmark's report: markdown tables (targets, policy comparison, scenarios) and plots."""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.routing_client import fmt

if TYPE_CHECKING:
    from bench.routing_scenarios import Plan


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    measured: str
    passed: bool


def _ms(v: float) -> str:
    return fmt(v * 1000, ".0f")


def policy_table(rows: list[dict[str, Any]], ref: dict[str, Any] | None) -> list[str]:
    lines = [
        "| policy | engine hit rate | usage cached share | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| throughput tok/s | req/s | SLA attainment (x-sla-ttft-ms) | TTFT <= 1.5 s | in-flight max/mean "
        "| served max/mean | $ per 1M output tokens "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in [*rows, *([{**ref, "policy": "reference: 1 backend, infinite KV"}] if ref else [])]:
        lines.append(
            f"| {r['policy']} | {fmt(r['hit_rate'], '.1%')} | {fmt(r['usage_hit_rate'], '.1%')} "
            f"| {_ms(r['ttft_p50_s'])} "
            f"| {_ms(r['ttft_p99_s'])} | {_ms(r['itl_p50_s'])} | {_ms(r['itl_p99_s'])} "
            f"| {fmt(r['throughput_tok_s'], '.0f')} | {fmt(r['throughput_rps'], '.2f')} "
            f"| {fmt(r['sla_attainment'], '.1%')} | {fmt(r['ttft_within_objective'], '.1%')} "
            f"| {fmt(r['inflight_max_mean'])} | {fmt(r['served_max_mean'])} "
            f"| {fmt(r['usd_per_1m_tokens'], '.0f')} | {r['errors']} |")
    return lines


def ttft_breakdown(rows: list[dict[str, Any]]) -> list[str]:
    """Why TTFT p50 does not halve: the TTFT of requests served (almost) wholly from cache is a floor
    of engine iterations, whatever the routing."""
    if not rows or "cached90_share" not in rows[0]:
        return []
    parts = [f"{r['policy']}: {fmt(r['cached90_share'], '.0%')} of requests >= 90% cached, TTFT p50 "
             f"{_ms(r['ttft_p50_cached90_s'])} ms for those vs {_ms(r['ttft_p50_rest_s'])} ms for the rest"
             for r in rows]
    reasons = next((r["reasons"] for r in rows if r["policy"] == "prefix_affinity"), None)
    return ["TTFT breakdown (simulated ms): " + "; ".join(parts) + "."
            + (f" prefix_affinity route reasons: {reasons}." if reasons else "")]


def working_set_section(ws: dict[str, Any], plan: Plan, stem: str) -> list[str]:
    ref = ws["reference"]
    lines = [
        "## Working-set sweep (prefix_affinity vs round_robin)",
        "",
        f"The multi-tenant workload above, unchanged (same {ws['requests']} requests, same "
        f"{ws['rate_rps']:.2f} req/s = {plan.load:.0%} load), over {plan.backends}-backend fleets whose KV per "
        f"backend is set so that the working set ({ws['working_set_tokens']:,} distinct prompt tokens) is "
        + ", ".join(f"{pt['factor']:g}x" for pt in ws["points"] if not pt["original"])
        + f" one backend's cache (at {plan.backends}x the fleet's caches together just hold it). **The original "
        f"configuration is the row marked 'original'** (KV "
        f"{ws['original_kv_tokens']:,} tokens per backend, working set {ws['original_factor']:.2f}x one backend's "
        "KV; its numbers are the multi-tenant table's). 'vs reference' is prefix_affinity's engine hit rate over "
        f"the one-infinite-backend reference's ({fmt(ref['hit_rate'], '.1%')}; offline ideal "
        f"{ws['ideal_hit_rate']:.1%}); imbalance is prefix_affinity's."
        + (" Quick mode scales the KV and the working set by 1/4 but not the prompts, so the requests being "
           "served take a 4x larger share of each cache than in the full run: its small-KV points are harsher "
           "on round_robin (the full run is the reference)." if plan.quick else ""),
        "",
        "| working set / one backend's KV | KV per backend (tokens) | round_robin hit | prefix_affinity hit "
        "| vs reference | round_robin TTFT p50 ms | prefix_affinity TTFT p50 ms | TTFT p50 ratio | round_robin TTFT "
        "p99 ms | prefix_affinity TTFT p99 ms | in-flight max/mean | served max/mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pt in ws["points"]:
        rr, pa = pt["rows"]["round_robin"], pt["rows"]["prefix_affinity"]
        tag = " (original)" if pt["original"] else ""
        lines.append(
            f"| {pt['factor']:.2f}x{tag} | {pt['kv_tokens']:,} | {fmt(rr['hit_rate'], '.1%')} "
            f"| {fmt(pa['hit_rate'], '.1%')} | {fmt(pa['hit_rate'] / ref['hit_rate'], '.0%')} "
            f"| {_ms(rr['ttft_p50_s'])} | {_ms(pa['ttft_p50_s'])} | {fmt(rr['ttft_p50_s'] / pa['ttft_p50_s'])}x "
            f"| {_ms(rr['ttft_p99_s'])} | {_ms(pa['ttft_p99_s'])} | {fmt(pa['inflight_max_mean'])} "
            f"| {fmt(pa['served_max_mean'])} |")
    pts = ws["points"]
    ratios = [(pt["factor"], pt["rows"]["round_robin"]["ttft_p50_s"] / pt["rows"]["prefix_affinity"]["ttft_p50_s"])
              for pt in pts]
    met = [f for f, r in ratios if r >= 2]
    pa50 = [pt["rows"]["prefix_affinity"]["ttft_p50_s"] * 1000 for pt in pts]
    rr50 = [pt["rows"]["round_robin"]["ttft_p50_s"] * 1000 for pt in pts]
    rrhit = [pt["rows"]["round_robin"]["hit_rate"] for pt in pts]
    pahit = [pt["rows"]["prefix_affinity"]["hit_rate"] for pt in pts]
    lines += ["", "Reading: as the working set grows from " + f"{pts[0]['factor']:.2f}x to {pts[-1]['factor']:.2f}x "
              f"one backend's KV, round_robin's hit rate falls from {rrhit[0]:.0%} to {rrhit[-1]:.0%} and its TTFT "
              f"p50 rises from {rr50[0]:.0f} to {rr50[-1]:.0f} ms, while prefix_affinity keeps {min(pahit):.0%}-"
              f"{max(pahit):.0%} hits and a TTFT p50 of {min(pa50):.0f}-{max(pa50):.0f} ms (a request served from "
              "cache still waits for one to two engine iterations: see the breakdown below). The 2x TTFT p50 target is "
              + (f"met at {', '.join(f'{f:.2f}x' for f in met)}" if met else "not met at any point")
              + "; ratios: " + ", ".join(f"{f:.2f}x -> {r:.2f}" for f, r in ratios) + "."]
    lines += ["", *ttft_breakdown([{**r, "policy": f"{p} at {pt['factor']:.2f}x"} for pt in ws["points"]
                                   for p, r in pt["rows"].items()]),
              "", f"![working-set sweep]({stem}_working_set.png)", ""]
    return lines


def markdown(res: dict[str, Any], targets: list[Target], *, plan: Plan, argv: list[str], rev: str,
             elapsed_s: float, stem: str = "routing") -> str:
    cmd = " ".join(["python -m bench.routing", *argv])
    out = [
        "# Routing quality (emulated fleets)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}; commit `{rev}`; "
        f"machine: {platform.node()}, {os.cpu_count()} cores, {platform.platform()}",
        f"- command: `{cmd}` ({'quick' if plan.quick else 'full'} mode, {elapsed_s:.0f} s wall)",
        f"- plan: {asdict(plan)}",
        f"- fleet: {plan.backends} x vLLM emulator, profile deepseek-v3-8xh200 (64-token blocks, 15k tok/s prefill, "
        f"$96/h per backend), KV "
        f"{'500k tokens (the profile)' if plan.kv_tokens is None else f'{plan.kv_tokens} tokens'}"
        " per backend; every run starts a fresh fleet process (`bench/routing_fleet.py`) and a fresh "
        "`python -m gateway serve` process; the client replays open loop (aiohttp, streaming, "
        "`stream_options.include_usage`)",
        f"- time: the emulators run at speed {plan.speed:g} (simulated s per wall s); every latency, "
        "throughput and cost below is in SIMULATED seconds = client-measured wall time x speed",
        "- hit rate: the engines' own `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`, summed "
        "over the fleet (deltas over the run); 'usage cached share' is sum(cached_tokens)/sum(prompt_tokens) "
        "from the responses",
        "- load imbalance: the gateway's per-backend in-flight count from `/admin/backends` sampled every "
        "100 ms; 'in-flight max/mean' = the most loaded backend's time-averaged in-flight over the fleet mean; "
        "'served max/mean' = the same for requests served; per-sample p95 (samples with >= 2 in flight per "
        "backend) in the targets",
        "- cost: usd_per_hour of every backend x simulated duration / output tokens",
        "",
        "## Targets",
        "",
        "| target | measured | result |",
        "|---|---|---|",
        *[f"| {t.name} | {t.measured} | {'PASS' if t.passed else 'FAIL'} |" for t in targets],
        "",
    ]
    mt = res.get("multi-tenant")
    if mt:
        spec = mt["spec"]
        out += [
            "## Every policy, multi-tenant shared-prefix workload",
            "",
            f"Workload (`bench/workload.py`, seed {spec.seed}): {spec.requests} requests, Poisson at "
            f"{spec.rate_rps:.2f} req/s (simulated) = {plan.load:.0%} of the fleet capacity "
            f"{mt['capacity_rps']:.2f} req/s; capacity computed from the profile: backends x 1 / (mean prompt "
            f"{mt['mean_prompt_tokens']:.0f} tokens / 15k tok/s prefill + mean max_tokens x 0.3 ms decode floor), "
            "i.e. prefill-bound with NO prefix reuse (the load every policy would face if caching did not help). "
            f"Mix: {spec.chat_share:.0%} tenant chat ({spec.tenants} tenants, system prompts "
            f"{spec.system_tokens[0]}-{spec.system_tokens[1]} tokens), {spec.session_share:.0%} multi-turn sessions "
            f"({spec.active_sessions} live, up to {spec.max_turns} turns, `x-session-id`), the rest RAG over "
            f"{spec.docs} documents of {spec.doc_tokens[0]}-{spec.doc_tokens[1]} tokens (Zipf reads, "
            f"`x-prefix-key`); max_tokens {spec.max_tokens[0]}-{spec.max_tokens[1]}. One infinite cache would hit "
            f"{mt['ideal_hit_rate']:.1%} of prompt tokens (offline count, 16-token blocks); the reference run "
            "replays the same requests on ONE backend with a 1e9-token KV at the same per-backend load "
            f"(arrivals {plan.backends}x slower, speed {plan.backends}x higher). Medians over {plan.repeats} "
            "repeat(s).",
            "",
            *policy_table(mt["table"], mt["reference"]),
            "",
            "Per-backend engine hit rate: " + "; ".join(
                f"{r['policy']}: " + ", ".join(f"{k} {fmt(v, '.0%')}" for k, v in r["per_backend_hit_rate"].items())
                for r in mt["table"] if r["policy"] in ("prefix_affinity", "round_robin")),
            "",
            f"![TTFT CDF]({stem}_ttft_cdf.png) ![hit rate and imbalance]({stem}_bars.png)",
            "",
            *ttft_breakdown([*[r for r in mt["table"] if r["policy"] in ("round_robin", "prefix_affinity")],
                             {**mt["reference"], "policy": "reference"}]),
            "",
        ]
    ws = res.get("working-set")
    if ws:
        out += working_set_section(ws, plan, stem)
    hot = res.get("hot-tenant")
    if hot:
        out += ["## Hot tenant (tenant 0 has half of the chat and session traffic)", "",
                f"{hot['spec'].requests} requests at {hot['spec'].rate_rps:.2f} req/s.", "",
                *policy_table(hot["rows"], None), "",
                "Requests served per backend: " + "; ".join(f"{r['policy']}: {r['served']}" for r in hot["rows"]), ""]
    two = res.get("two-gateways")
    if two:
        out += ["## Two gateways, no shared state", "",
                f"{two['prefixes']} new prefixes (500-2000 tokens), each sent once through gateway A and once "
                f"through gateway B at the same moment (Poisson, 2 new prefixes per simulated second), both "
                f"`prefix_affinity` over the same 4-backend fleet: {two['same_backend']} landed on the same backend "
                f"({two['share']:.1%}). Route reasons: {two['reasons']}; errors: {two['errors']}. Idle placement "
                f"(one new ~800-token prefix at a time, A then B, nothing else in flight): {two['idle_same']}/"
                f"{two['idle_prefixes']} on the same backend.", ""]
    het = res.get("heterogeneous")
    if het:
        r = het["row"]
        out += ["## Heterogeneous fleet, `sla` policy", "",
                f"Backends: fast0, fast1 (profile), slow3x (every iteration cost x3, prefill rate / 3), busy "
                f"(profile, plus background load sent directly to it at {het['bg_rate_rps']:.1f} req/s of 4k "
                f"uncached tokens = 1.5x its prefill capacity). {het['spec'].requests} requests at "
                f"{het['spec'].rate_rps:.2f} req/s (60% of two fast backends + one third), every one with "
                f"`x-sla-ttft-ms` = {het['target_ms']:.0f} ms simulated (sent as {het['target_ms'] / plan.speed:.0f} "
                f"wall ms: the gateway sees wall time). The fast backends' own TTFT p99 in this run: "
                f"{het['fast_ttft_p99_s'] * 1000:.0f} ms, so the target is feasible.", "",
                *policy_table([{**r, "policy": "sla"}], None), "",
                f"Requests served per backend: {r['served']}.", ""]
    ab = res.get("ab")
    if ab:
        out += ["## A/B split 70/30", "",
                f"{ab['sessions']} sessions (`x-session-id`), two requests each in shuffled order, through a split "
                f"route (arm vllm: one vLLM emulator, weight 70; arm sglang: one SGLang emulator, weight 30): "
                f"vllm share {ab['vllm_share']:.2%} (expected 70%, SE {ab['stderr']:.2%}, z = {ab['z']:+.2f}); "
                f"{ab['sticky_sessions']}/{ab['answered_sessions']} sessions always got the same `x-gateway-arm`; "
                f"errors {ab['errors']}.", ""]
    return "\n".join(out)


def plots(res: dict[str, Any], out: Path, stem: str = "routing") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ws = res.get("working-set")
    if ws:
        working_set_plot(ws, out, stem, plt)
    mt = res.get("multi-tenant")
    if not mt:
        return
    rows = [r for r in mt["rows"] if r.get("repeat", 0) == 0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in [*rows, {**mt["reference"], "policy": "reference (1 infinite backend)"}]:
        xs = sorted(r["ttfts_s"])
        if xs:
            ax.plot([x * 1000 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=r["policy"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (simulated ms)")
    ax.set_ylabel("CDF")
    ax.set_title("TTFT per policy, multi-tenant workload, 4 emulated vLLM backends")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{stem}_ttft_cdf.png", dpi=110)
    plt.close(fig)
    table = mt["table"]
    names = [r["policy"] for r in table]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(names, [r["hit_rate"] for r in table])
    a.axhline(mt["reference"]["hit_rate"], color="k", ls="--", label="1 infinite backend")
    a.set_ylabel("engine prefix-cache hit rate")
    a.set_ylim(0, 1)
    a.legend(fontsize=8)
    a.tick_params(axis="x", rotation=30)
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [r["inflight_max_mean"] for r in table], width=0.4, label="in-flight max/mean")
    b.bar([i + 0.2 for i in x], [r["served_max_mean"] for r in table], width=0.4, label="served max/mean")
    b.axhline(1.5, color="r", ls="--", label="target 1.5")
    b.set_xticks(list(x), names, rotation=30)
    b.set_ylabel("load imbalance (max/mean)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{stem}_bars.png", dpi=110)
    plt.close(fig)


def working_set_plot(ws: dict[str, Any], out: Path, stem: str, plt: Any) -> None:
    pts = ws["points"]
    xs = [pt["factor"] for pt in pts]
    rr = [pt["rows"]["round_robin"] for pt in pts]
    pa = [pt["rows"]["prefix_affinity"] for pt in pts]
    orig = [pt["factor"] for pt in pts if pt["original"]]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    a.plot(xs, [r["ttft_p50_s"] / p["ttft_p50_s"] for r, p in zip(rr, pa, strict=True)], "o-",
           label="round_robin / prefix_affinity")
    a.axhline(2.0, color="r", ls="--", label="target 2x")
    a.set_ylabel("TTFT p50 ratio")
    b.plot(xs, [r["hit_rate"] for r in rr], "o-", label="round_robin")
    b.plot(xs, [p["hit_rate"] for p in pa], "o-", label="prefix_affinity")
    b.axhline(ws["reference"]["hit_rate"], color="k", ls="--", label="1 infinite backend")
    b.set_ylabel("engine prefix-cache hit rate")
    b.set_ylim(0, 1)
    c.plot(xs, [p["inflight_max_mean"] for p in pa], "o-", label="in-flight max/mean")
    c.plot(xs, [p["served_max_mean"] for p in pa], "o-", label="served max/mean")
    c.axhline(1.5, color="r", ls="--", label="target 1.5")
    c.set_ylabel("prefix_affinity load imbalance")
    for ax in (a, b, c):
        for x in orig:
            ax.axvline(x, color="grey", ls=":", label="original configuration")
        ax.set_xlabel("working set / one backend's KV cache")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Same multi-tenant workload at 70% load, 4 emulated vLLM backends, KV per backend varied")
    fig.tight_layout()
    fig.savefig(out / f"{stem}_working_set.png", dpi=110)
    plt.close(fig)
