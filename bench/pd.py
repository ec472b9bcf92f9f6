"""Prefill/decode disaggregation against aggregated serving, on emulated vLLM servers, side by side.

    python -m bench pd [--quick] [--requests N] [--concurrency C] [--speed X]

Three pools of the same size (4 emulated vLLM servers, DeepSeek-V3 on 8xH200 profile, the
emulator's iteration model: a prefill in an iteration delays every decode of that batch):

* `aggregated`: 4 ordinary servers, `least_load`;
* `pd`: 2 prefill + 2 decode servers (NixlConnector roles: the decode pulls the prefill's KV over
  the emulated side channel, the modelled transfer time included), `disaggregation: {when: always}`;
* `auto`: 4 `both` servers (kv_both), `disaggregation: {when: auto, min_uncached_tokens: 1024}`.

Each pool is a fresh fleet and a fresh `gateway serve`, given two workloads one after the other,
each a closed loop of C concurrent streaming clients: `long` (distinct ~4,000-token prompts, 64
output tokens) and `short` (distinct ~60-token prompts, 64 output tokens). TTFT is client-measured
(request sent to the first content chunk); output tokens/s is the completion tokens over the
workload's span. Times are in simulated seconds (wall x speed). Results: bench/results/pd.md, pd.json,
pd.png.
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
POOLS = ("aggregated", "pd", "auto")
WORKLOADS = {"long": 4000, "short": 60}  # prompt words (the emulator's tokenizer: about one token each)
OUTPUT_TOKENS = 64
AUTO_MIN_UNCACHED = 1024
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="32 requests per workload and pool (about 3 minutes)")
    p.add_argument("--requests", type=int, default=None, help="requests per workload and pool (default 96)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--speed", type=float, default=1.0, help="emulator speed (simulated s per wall s)")
    p.add_argument("--out", type=Path, default=RESULTS)


Role = Literal["prefill", "decode", "both"]
ROLES: dict[str, list[Role | None]] = {"aggregated": [None] * 4, "pd": ["prefill", "prefill", "decode", "decode"],
                                       "auto": ["both"] * 4}


def roles(pool: str) -> list[Role | None]:
    return ROLES[pool]


def route(pool: str, names: list[str]) -> dict[str, Any]:
    r: dict[str, Any] = {"model": "m", "backends": names, "policy": "least_load"}
    if pool == "pd":
        r["disaggregation"] = {"when": "always"}
    elif pool == "auto":
        r["disaggregation"] = {"when": "auto", "min_uncached_tokens": AUTO_MIN_UNCACHED}
    return r


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Stats:
    ttft_s: list[float]
    output_tokens: int
    span_s: float
    errors: int


async def one(session: Any, url: str, text: str) -> tuple[float | None, int]:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": OUTPUT_TOKENS,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first: float | None = None
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
            if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter() - sent
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return first, tokens


async def workload(url: str, words: int, requests: int, concurrency: int, seed: int) -> Stats:
    import aiohttp

    rng = random.Random(seed)
    texts = [prompt(rng, words) for _ in range(requests)]
    queue = list(reversed(texts))
    ttfts: list[float] = []
    totals = [0, 0]

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            ttft, tokens = await one(session, url, queue.pop())
            if ttft is None:
                totals[1] += 1
            else:
                ttfts.append(ttft)
                totals[0] += tokens

    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return Stats(ttfts, totals[0], time.perf_counter() - started, totals[1])


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
            stats = await workload(url, words, requests, args.concurrency, seed=100 * n)
            out[name] = summarise(stats, args.speed)
            print(f"  {pool:>10} {name:>5}: TTFT p50 {out[name]['ttft_p50_s']:.3f} s, p99 "
                  f"{out[name]['ttft_p99_s']:.3f} s, {out[name]['output_tokens_per_s']:.0f} output tokens/s, "
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


def summarise(s: Stats, speed: float) -> dict[str, Any]:
    return {"requests": len(s.ttft_s), "errors": s.errors, "ttft_p50_s": percentile(s.ttft_s, 0.5) * speed,
            "ttft_p99_s": percentile(s.ttft_s, 0.99) * speed,
            "output_tokens_per_s": s.output_tokens / (s.span_s * speed) if s.span_s > 0 else 0.0}


def report(results: dict[str, Any], meta: dict[str, Any], out: Path) -> None:
    lines = ["# Prefill/decode disaggregation vs aggregated serving (emulated vLLM)", "",
             f"{meta['date']}, commit {meta['commit']}, {meta['nproc']} cores ({meta['cpu']}), {meta['build']}.",
             f"Command: `{meta['command']}`. {meta['requests']} requests per workload and pool, "
             f"{meta['concurrency']} concurrent streaming clients, emulator speed {meta['speed']}x; times in "
             "simulated seconds. Pools of 4 servers: `aggregated` (4 ordinary), `pd` (2 prefill + 2 decode, "
             "`when: always`), `auto` (4 `both`, `when: auto`, "
             f"`min_uncached_tokens: {AUTO_MIN_UNCACHED}`).", "",
             "| workload | pool | TTFT p50 (s) | TTFT p99 (s) | output tokens/s | errors |",
             "|---|---|---|---|---|---|"]
    for w in WORKLOADS:
        for pool in POOLS:
            r = results[pool][w]
            lines.append(f"| {w} (~{WORKLOADS[w]} prompt tokens) | {pool} | {r['ttft_p50_s']:.3f} | "
                         f"{r['ttft_p99_s']:.3f} | {r['output_tokens_per_s']:.0f} | {r['errors']} |")
    lines += ["", "What `auto` decided (gateway counters, both workloads):", ""]
    for k, v in sorted(results["auto"]["gateway_metrics"].items()):
        lines.append(f"- `{k}`: {v:.0f}")
    lines += ["", "![TTFT and throughput by pool](pd.png)", ""]
    (out / "pd.md").write_text("\n".join(lines))
    (out / "pd.json").write_bytes(orjson.dumps({"meta": meta, "results": results}, option=orjson.OPT_INDENT_2))
    plot(results, out / "pd.png")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    x = range(len(WORKLOADS))
    width = 0.26
    for ax, (key, title) in zip(axes, (("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p99_s", "TTFT p99 (s)"),
                                       ("output_tokens_per_s", "output tokens/s")), strict=True):
        for i, pool in enumerate(POOLS):
            ax.bar([j + (i - 1) * width for j in x], [results[pool][w][key] for w in WORKLOADS], width, label=pool)
        ax.set_xticks(list(x), list(WORKLOADS))
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    requests = args.requests or (32 if args.quick else 96)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**run_info.machine_info(argv), "requests": requests, "concurrency": args.concurrency, "speed": args.speed}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pool in POOLS:
            print(f"pool {pool}", flush=True)
            results[pool] = asyncio.run(run_pool(pool, args, requests, Path(tmp)))
    report(results, meta, args.out)
    print(f"wrote {args.out / 'pd.md'}")
    return 0
