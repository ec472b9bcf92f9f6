"""Prefill/decode disaggregation against aggregated serving, on emulated vLLM servers, side by side.

    python -m bench pd [--quick] [--requests N] [--concurrency C] [--output-tokens T] [--pools a,b]
                       [--slo-ttft S] [--slo-itl S] [--speed X]

Four pools of the same size (4 emulated vLLM servers, DeepSeek-V3 on 8xH200 profile, the
emulator's iteration model: a prefill in an iteration delays every decode of that batch):

* `aggregated`: 4 ordinary servers, `least_load`;
* `pd`: 2 prefill + 2 decode servers (NixlConnector roles: the decode pulls the prefill's KV over
  the emulated side channel, the modelled transfer time included), `disaggregation: {when: always}`;
* `auto`: the same 2 + 2 servers with `disaggregation: {when: auto, min_uncached_tokens: 1024}`
  (a request is served whole on a decode server when splitting is predicted to cost more time);
* `auto-both`: 4 `both` servers (kv_both), `when: auto`: every server may prefill or decode.

Each pool is a fresh fleet and a fresh `gateway serve`, given two workloads one after the other,
each a closed loop of C concurrent streaming clients: `long` (distinct ~4,000-token prompts) and
`short` (distinct ~60-token prompts), T output tokens each. Client-measured: TTFT (request sent to
the first content chunk), inter-token latency (the gaps between content chunks, p50 and p99 over all
requests), output tokens/s (completion tokens over the workload's span) and SLO attainment: the
share of requests whose TTFT is within `--slo-ttft` and whose longest gap is within `--slo-itl`
(DistServe's goodput criterion, with the worst gap instead of the mean so a prefill stall counts).
Times are in simulated seconds (wall x speed). Results: bench/results/pd.md, pd.json, pd.png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
import yaml

from backends.base import Runtime
from backends.emulator import DisaggConfig, EmulatorConfig, RunningEmulator, start_emulator
from bench import run_info
from bench.procs import ROOT, Proc

RESULTS = ROOT / "bench" / "results"
PROFILE = "deepseek-v3-8xh200"
POOLS = ("aggregated", "pd", "auto", "auto-both")
AUTO_POOLS = ("auto", "auto-both")
WORKLOADS = {"long": 4000, "short": 60}  # prompt words (the emulator's tokenizer: about one token each)
OUTPUT_TOKENS = 64
SLO_TTFT_S = 1.0  # a long prompt's whole prefill on an idle server is ~0.45 s in this profile
SLO_ITL_S = 0.15  # three decode steps: one prefill-stalled step breaks it
AUTO_MIN_UNCACHED = 1024
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="32 requests per workload and pool (about 3 minutes)")
    p.add_argument("--requests", type=int, default=None, help="requests per workload and pool (default 96)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS, help="max_tokens of every request")
    p.add_argument("--speed", type=float, default=1.0, help="emulator speed (simulated s per wall s)")
    p.add_argument("--pools", default=",".join(POOLS), help=f"comma-separated subset of {', '.join(POOLS)}")
    p.add_argument("--slo-ttft", type=float, default=SLO_TTFT_S, help="SLO on TTFT, simulated seconds")
    p.add_argument("--slo-itl", type=float, default=SLO_ITL_S, help="SLO on a request's longest gap, simulated s")
    p.add_argument("--out", type=Path, default=RESULTS)


Role = Literal["prefill", "decode", "both"]
ROLES: dict[str, list[Role | None]] = {"aggregated": [None] * 4, "pd": ["prefill", "prefill", "decode", "decode"],
                                       "auto": ["prefill", "prefill", "decode", "decode"], "auto-both": ["both"] * 4}


def roles(pool: str) -> list[Role | None]:
    return ROLES[pool]


def route(pool: str, names: list[str]) -> dict[str, Any]:
    r: dict[str, Any] = {"model": "m", "backends": names, "policy": "least_load"}
    if pool == "pd":
        r["disaggregation"] = {"when": "always"}
    elif pool in AUTO_POOLS:
        r["disaggregation"] = {"when": "auto", "min_uncached_tokens": AUTO_MIN_UNCACHED}
    return r


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Stats:
    ttft_s: list[float]
    worst_gap_s: list[float]  # per request, aligned with ttft_s
    itl_s: list[float]  # every gap of every request
    output_tokens: int
    span_s: float
    errors: int


async def one(session: Any, url: str, text: str, max_tokens: int, gaps: list[float]) -> tuple[float | None, int]:
    """One streamed request: its TTFT (None on an error) and completion tokens; the gaps between its
    content chunks (the client's inter-token latency) are appended to `gaps`, in order."""
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first: float | None = None
    last = 0.0
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return None, 0
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                if first is None:
                    first = now - sent
                else:
                    gaps.append(now - last)
                last = now
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return first, tokens


async def workload(url: str, words: int, requests: int, concurrency: int, max_tokens: int, seed: int) -> Stats:
    import aiohttp

    rng = random.Random(seed)
    texts = [prompt(rng, words) for _ in range(requests)]
    queue = list(reversed(texts))
    ttfts: list[float] = []
    worst: list[float] = []
    gaps: list[float] = []
    totals = [0, 0]

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            mine: list[float] = []
            ttft, tokens = await one(session, url, queue.pop(), max_tokens, mine)
            if ttft is None:
                totals[1] += 1
            else:
                ttfts.append(ttft)
                worst.append(max(mine, default=0.0))
                gaps.extend(mine)
                totals[0] += tokens

    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return Stats(ttfts, worst, gaps, totals[0], time.perf_counter() - started, totals[1])


async def run_pool(pool: str, args: argparse.Namespace, requests: int, tmp: Path) -> dict[str, Any]:
    emulators: list[RunningEmulator] = []
    gateway: Proc | None = None
    try:
        for i, role in enumerate(roles(pool)):
            cfg = EmulatorConfig(runtime=Runtime.VLLM, model="deepseek-v3", profile=PROFILE, speed=args.speed,
                                 max_model_len=32768, seed=i, disagg=None if role is None else DisaggConfig(role=role))
            emulators.append(await start_emulator(cfg))
        names = [f"{pool}-{i}" for i in range(len(emulators))]
        backends = [{"name": n, "runtime": "vllm", "url": e.url, "model": "deepseek-v3", "usd_per_hour": 96.0,
                     **({"role": r} if r is not None else {})}
                    for n, e, r in zip(names, emulators, roles(pool), strict=True)]
        config = {"backends": backends, "routes": [route(pool, names)], "health": {"interval_s": 0.5},
                  "timeouts": {"first_token_s": 300, "total_s": 600}}
        path = tmp / f"{pool}.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = Proc(f"gateway-{pool}", [sys.executable, "-m", "gateway", "serve", "--config", str(path),
                                           "--port", "0"], log=tmp / f"{pool}.log", stdout_pipe=True)
        line = await asyncio.to_thread(gateway.read_line, "gateway listening on ")
        url = line.split()[3]
        out: dict[str, Any] = {}
        for n, (name, words) in enumerate(WORKLOADS.items()):
            stats = await workload(url, words, requests, args.concurrency, args.output_tokens, seed=100 * n)
            r = out[name] = summarise(stats, args.speed, args.slo_ttft, args.slo_itl)
            print(f"  {pool:>10} {name:>5}: TTFT p50 {r['ttft_p50_s']:.3f} s, p99 {r['ttft_p99_s']:.3f} s, ITL p50 "
                  f"{r['itl_p50_s'] * 1000:.0f} ms, p99 {r['itl_p99_s'] * 1000:.0f} ms, "
                  f"{r['output_tokens_per_s']:.0f} output tokens/s, SLO met {r['slo_attainment']:.0%}, "
                  f"{stats.errors} errors", flush=True)
        out["gateway_metrics"] = await asyncio.to_thread(pd_counters, url)
        return out
    finally:
        if gateway is not None:
            gateway.stop()
        for e in emulators:
            await e.stop()


def pd_counters(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name in ("gateway_pd_decisions_total", "gateway_pd_requests_total"):
                key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model") + "}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summarise(s: Stats, speed: float, slo_ttft: float, slo_itl: float) -> dict[str, Any]:
    met = sum(1 for t, g in zip(s.ttft_s, s.worst_gap_s, strict=True) if t * speed <= slo_ttft and g * speed <= slo_itl)
    sent = len(s.ttft_s) + s.errors
    return {"requests": len(s.ttft_s), "errors": s.errors, "ttft_p50_s": percentile(s.ttft_s, 0.5) * speed,
            "ttft_p99_s": percentile(s.ttft_s, 0.99) * speed, "itl_p50_s": percentile(s.itl_s, 0.5) * speed,
            "itl_p99_s": percentile(s.itl_s, 0.99) * speed,
            "output_tokens_per_s": s.output_tokens / (s.span_s * speed) if s.span_s > 0 else 0.0,
            "slo_attainment": met / sent if sent else 0.0}


POOL_TEXT = {"aggregated": "4 ordinary servers", "pd": "2 prefill + 2 decode, `when: always`",
             "auto": f"2 prefill + 2 decode, `when: auto`, `min_uncached_tokens: {AUTO_MIN_UNCACHED}`",
             "auto-both": "4 `both` servers, `when: auto`"}
PANELS = (("ttft_p50_s", "TTFT p50 (s)"), ("itl_p99_s", "inter-token latency p99 (s)"),
          ("output_tokens_per_s", "output tokens/s"), ("slo_attainment", "SLO attainment"))


def report(results: dict[str, Any], meta: dict[str, Any], out: Path) -> None:
    ran = list(results)
    lines = ["# Prefill/decode disaggregation vs aggregated serving (emulated vLLM)", "",
             f"{meta['date']}, commit {meta['commit']}, {meta['nproc']} cores ({meta['cpu']}), {meta['build']}.",
             f"Command: `{meta['command']}`. {meta['requests']} requests per workload and pool, "
             f"{meta['concurrency']} concurrent streaming clients, {meta['output_tokens']} output tokens each, "
             f"emulator speed {meta['speed']}x; times in simulated seconds. Pools of 4 servers: "
             + "; ".join(f"`{p}` ({POOL_TEXT[p]})" for p in ran) + ". SLO: TTFT within "
             f"{meta['slo_ttft_s']} s and no gap between tokens over {meta['slo_itl_s']} s.", "",
             "| workload | pool | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) | output tokens/s "
             "| SLO met | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for w in WORKLOADS:
        best = max(results[p][w]["slo_attainment"] for p in ran)
        for pool in ran:
            r = results[pool][w]
            slo = f"{r['slo_attainment']:.0%}"
            lines.append(f"| {w} (~{WORKLOADS[w]} prompt tokens) | {pool} | {r['ttft_p50_s']:.3f} | "
                         f"{r['ttft_p99_s']:.3f} | {r['itl_p50_s'] * 1000:.0f} | {r['itl_p99_s'] * 1000:.0f} | "
                         f"{r['output_tokens_per_s']:.0f} | {f'**{slo}**' if r['slo_attainment'] == best else slo} | "
                         f"{r['errors']} |")
    for pool in (p for p in AUTO_POOLS if p in results):
        lines += ["", f"What `{pool}` decided (gateway counters, both workloads):", ""]
        lines += [f"- `{k}`: {v:.0f}" for k, v in sorted(results[pool]["gateway_metrics"].items())]
    lines += ["", "![TTFT, inter-token latency, throughput and SLO attainment by pool](pd.png)", ""]
    (out / "pd.md").write_text("\n".join(lines))
    (out / "pd.json").write_bytes(orjson.dumps({"meta": meta, "results": results}, option=orjson.OPT_INDENT_2))
    plot(results, out / "pd.png")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = list(results)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(17, 4))
    width = 0.8 / len(ran)
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for i, pool in enumerate(ran):
            offset = (i - (len(ran) - 1) / 2) * width
            ax.bar([j + offset for j in range(len(WORKLOADS))], [results[pool][w][key] for w in WORKLOADS], width,
                   label=pool)
        ax.set_xticks(range(len(WORKLOADS)), list(WORKLOADS))
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def pools(spec: str) -> list[str]:
    chosen = [p.strip() for p in spec.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(POOLS))
    if unknown:
        raise SystemExit(f"unknown pool(s) {', '.join(unknown)}; known: {', '.join(POOLS)}")
    return [p for p in POOLS if p in chosen]


def run(args: argparse.Namespace, argv: list[str]) -> int:
    requests = args.requests or (32 if args.quick else 96)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**run_info.machine_info(argv), "requests": requests, "concurrency": args.concurrency, "speed": args.speed,
            "output_tokens": args.output_tokens, "slo_ttft_s": args.slo_ttft, "slo_itl_s": args.slo_itl}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pool in pools(args.pools):
            print(f"pool {pool}", flush=True)
            results[pool] = asyncio.run(run_pool(pool, args, requests, Path(tmp)))
    report(results, meta, args.out)
    print(f"wrote {args.out / 'pd.md'}")
    return 0
