"""Routing quality on two REAL vLLM CPU servers (tiny random-weight MoE): round_robin, prefix_affinity
on the approximate index, and prefix_affinity on the servers' own KV-cache events.

For each arm: two fresh vLLM servers (`--enable-prefix-caching --enable-prompt-tokens-details
--enforce-eager --num-gpu-blocks-override N`, 128-token blocks on CPU, `--kv-events-config` publishing
to a socket the gateway binds) and a fresh gateway process; the same seeded multi-tenant workload
(long per-tenant system prompts) is replayed at low concurrency. The `prefix_affinity+events` arm
gives the gateway the servers' `kv_events` and the tiny model's tokenizer (`tokenizer:
~/.cache/igw/tiny-moe`). Judged by vLLM's own `vllm:prefix_cache_hits_total /
vllm:prefix_cache_queries_total` summed over the two servers, by client-measured TTFT, and by how
often the gateway's `x-gateway-expected-cached-tokens` equalled vLLM's `cached_tokens`. N is chosen so
that one server's KV holds fewer than all tenants' prefixes while the pair holds them all.

    python -m bench.real_vllm [--blocks 56] [--tenants 12] [--requests 160]   (or `python -m bench real-vllm`)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench.cli import standalone
from bench.procs import ROOT, Proc, free_port
from bench.routing_client import Result, fmt, hit_counters, pct, scrape, stream_one, to_jsonable
from bench.workload import TimedRequest, words

CACHE = Path(os.environ.get("IGW_CACHE") or Path.home() / ".cache" / "igw")
VLLM_PYTHON = CACHE / "vllm-venv" / "bin" / "python"
MODEL_DIR = CACHE / "tiny-moe"
SETUP = ROOT / "scripts" / "real_vllm" / "setup_env.sh"
RESULTS = ROOT / "bench" / "results"
BLOCK = 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=60, help="--num-gpu-blocks-override per server (128 tokens each)")
    p.add_argument("--tenants", type=int, default=24)
    p.add_argument("--system-words", type=int, default=200, help="words per system prompt (~2.8 real tokens each)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--policies", default="round_robin,prefix_affinity,prefix_affinity+events")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--note", default="", help="a line appended to the report (e.g. earlier runs)")
    p.add_argument("--report-only", action="store_true", help="re-render the report from real_vllm.json")


def workload(args: argparse.Namespace) -> list[TimedRequest]:
    """Tenant chat: a long system prompt per tenant, then a short question; tenants drawn uniformly."""
    text = random.Random(args.seed)
    systems = [f"You are the assistant of tenant {t}." + words(text, args.system_words) for t in range(args.tenants)]
    rng = random.Random(args.seed + 1)
    out = []
    for _ in range(args.requests):
        t = rng.randrange(args.tenants)
        messages = ({"role": "system", "content": systems[t]},
                    {"role": "user", "content": "Question:" + words(rng, 12)})
        out.append(TimedRequest(0.0, messages, args.max_tokens, {}, "chat", f"tenant-{t}"))
    return out


def start_vllm(port: int, blocks: int, log: Path, kv_port: int) -> Proc:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_SERVER_DEV_MODE": "1"}
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{kv_port}", "topic": "kv"}
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR),
            "--served-model-name", "tiny-moe", "--max-model-len", "2048", "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--enforce-eager", "--num-gpu-blocks-override", str(blocks),
            "--kv-events-config", orjson.dumps(kv).decode(), "--host", "127.0.0.1", "--port", str(port)]
    return Proc(f"vllm-{port}", argv, log=log, env=env)


def tokenization_cost(reqs: list[TimedRequest]) -> dict[str, float]:
    """What the `+events` arm's gateway spends tokenizing, measured on the same requests in the same
    order in this process (the same code and the same segment cache behaviour): µs per request."""
    from backends.base import Endpoint
    from gateway.tokenize import load
    from gateway.tokenize.loader import _LOADED

    _LOADED.pop(str(MODEL_DIR), None)  # a fresh tokenizer: empty segment cache, as at the gateway's start
    tok = load(str(MODEL_DIR))
    samples = []
    for r in reqs:
        body = {"model": "moe", "messages": list(r.messages)}
        t0 = time.perf_counter_ns()
        prompt = tok.prompt(body, Endpoint.CHAT)
        if prompt is not None:
            prompt.keys(BLOCK)
        samples.append((time.perf_counter_ns() - t0) / 1000)
    cold = samples[: len(samples) // 10]
    return {"tokenize_us_p50": pct(samples, 50), "tokenize_us_p99": pct(samples, 99),
            "tokenize_us_mean": sum(samples) / len(samples), "tokenize_us_first10pct_mean": sum(cold) / len(cold)}


async def wait_ok(url: str, proc: Proc, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"{proc.name} exited: {proc.log_path.read_text()[-3000:]}")
            try:
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=3)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


async def run_policy(arm: str, reqs: list[TimedRequest], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    policy = arm.removesuffix("+events")
    events = arm.endswith("+events")
    ports = [free_port(), free_port()]
    kv_ports = [free_port(), free_port()]
    servers = [start_vllm(p, args.blocks, tmp / f"vllm-{arm}-{i}.log", kv_ports[i]) for i, p in enumerate(ports)]
    gw: Proc | None = None
    try:
        t0 = time.monotonic()
        await asyncio.gather(*(wait_ok(f"http://127.0.0.1:{p}/health", s) for p, s in zip(ports, servers, strict=True)))
        startup = time.monotonic() - t0
        backends: list[dict[str, Any]] = [
            {"name": f"vllm-{i}", "runtime": "vllm", "url": f"http://127.0.0.1:{p}", "model": "tiny-moe"}
            for i, p in enumerate(ports)]
        route: dict[str, Any] = {"model": "moe", "backends": ["vllm-0", "vllm-1"], "policy": policy}
        if events:
            route["tokenizer"] = str(MODEL_DIR)
            for b, kv_port in zip(backends, kv_ports, strict=True):
                b["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{kv_port}", "bind": True, "topic": "kv"}
        config = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "backends": backends,
            "routes": [route],
            "health": {"interval_s": 1},
            "timeouts": {"first_token_s": 120, "total_s": 300},
        }
        tag = arm.replace("+", "-")
        path = tmp / f"gateway-{tag}.yaml"
        path.write_text(yaml.safe_dump(config))
        gw = Proc(f"gateway-{tag}", [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", "0"],
                  log=tmp / f"gateway-{tag}.log", stdout_pipe=True)
        url = gw.read_line("gateway listening on ").split()[-1]
        await asyncio.sleep(2.5)  # one health/metrics scrape so the gateway knows the 128-token blocks
        results: list[Result] = []
        queue = list(enumerate(reqs))
        async with aiohttp.ClientSession() as http:
            async def worker() -> None:
                while queue:
                    i, r = queue.pop(0)
                    results.append(await stream_one(http, url, r, i, model="moe", timeout_s=300))
            t1 = time.monotonic()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            wall = time.monotonic() - t1
            counters = [hit_counters(await scrape(http, f"http://127.0.0.1:{p}/metrics")) for p in ports]
            async with http.get(url + "/admin/backends") as admin:
                kv_states = [b["kv_events"] for b in (await admin.json())["backends"]]
        ok = [r for r in results if r.status == 200 and not r.error]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        hits, queries = sum(c[0] for c in counters), sum(c[1] for c in counters)
        by_backend: dict[str, int] = {}
        for r in ok:
            by_backend[r.backend] = by_backend.get(r.backend, 0) + 1
        tenants_on: dict[str, set[str]] = {}
        for r in ok:
            tenants_on.setdefault(r.backend, set()).add(r.group)
        predicted = [r for r in ok if r.expected_cached is not None]
        return {
            "policy": arm, "ok": len(ok), "errors": len(results) - len(ok),
            "prediction_exact_share": (sum(1 for r in predicted if r.expected_cached == r.cached_tokens)
                                       / len(predicted) if predicted else float("nan")),
            "predictions": len(predicted), "kv_events": kv_states,
            "hit_rate": hits / queries if queries else float("nan"), "hits": hits, "queries": queries,
            "per_server_hit_rate": [c[0] / c[1] if c[1] else float("nan") for c in counters],
            "usage_cached_share": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
            "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / max(1, len(ok)),
            "ttft_p50_ms": pct(ttfts, 50) * 1000, "ttft_p99_ms": pct(ttfts, 99) * 1000,
            "ttft_mean_ms": sum(ttfts) / max(1, len(ttfts)) * 1000, "wall_s": wall, "startup_s": startup,
            "requests_per_backend": by_backend,
            "tenants_per_backend": {b: len(t) for b, t in tenants_on.items()},
            "ttfts_ms": [t * 1000 for t in ttfts],
        }
    finally:
        if gw is not None:
            gw.stop()
        for s in servers:
            s.stop()


def write_report(rows: list[dict[str, Any]], args: argparse.Namespace, argv: list[str], out: Path,
                 tokenize: dict[str, float] | None = None) -> bool:
    by = {r["policy"]: r for r in rows}
    rr, pa, ev = by.get("round_robin"), by.get("prefix_affinity"), by.get("prefix_affinity+events")
    ratio = pa["hit_rate"] / rr["hit_rate"] if rr and pa and rr["hit_rate"] > 0 else float("nan")
    passed = ratio >= 1.5
    targets = [f"| prefix_affinity hit rate >= 1.5x round_robin's | {fmt(ratio, '.2f')}x | "
               f"{'PASS' if passed else 'FAIL'} |"]
    if ev is not None:
        exact_ok = ev["prediction_exact_share"] >= 0.99
        hit_ok = pa is None or ev["hit_rate"] >= pa["hit_rate"]
        passed = passed and exact_ok and hit_ok
        targets += [
            f"| with events: x-gateway-expected-cached-tokens = vLLM's cached_tokens for >= 99% of requests | "
            f"{fmt(ev['prediction_exact_share'], '.1%')} of {ev['predictions']} | {'PASS' if exact_ok else 'FAIL'} |",
            f"| with events: vLLM's hit rate >= the approximate index's | {fmt(ev['hit_rate'], '.1%')} vs "
            f"{fmt(pa['hit_rate'] if pa else float('nan'), '.1%')} | {'PASS' if hit_ok else 'FAIL'} |",
        ]
    git = ["git", "rev-parse", "--short", "HEAD"]
    rev = subprocess.run(git, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    mean_prompt = rows[0]["mean_prompt_tokens"] if rows else 0
    lines = [
        "# Routing on two real vLLM CPU servers",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}; commit `{rev}`; machine: "
        f"{platform.node()}, {os.cpu_count()} cores, {platform.platform()}",
        f"- command: `{' '.join(['python -m bench.real_vllm', *argv])}`",
        f"- servers: 2 x vllm-cpu 0.32.0, tiny random-weight MoE, `--enable-prefix-caching "
        f"--enable-prompt-tokens-details --enforce-eager --num-gpu-blocks-override {args.blocks}` "
        f"({args.blocks} x {BLOCK} = {args.blocks * BLOCK} KV tokens per server), max-model-len 2048; fresh "
        "servers and a fresh gateway per policy",
        f"- workload: {args.tenants} tenants, system prompt {args.system_words} words each (mean prompt "
        f"{mean_prompt:.0f} real tokens, i.e. ~{int(mean_prompt) // BLOCK} cacheable blocks per tenant, "
        f"{args.tenants * (int(mean_prompt) // BLOCK)} blocks for all tenants: more than one server's "
        f"{args.blocks} blocks, fewer than the pair's {2 * args.blocks}); {args.requests} requests, tenants "
        f"uniform at random, closed loop with concurrency {args.concurrency}, max_tokens {args.max_tokens}",
        "- hit rate = vLLM's own `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`, summed over "
        "both servers; TTFT measured at the client through the gateway (wall ms, no speed factor)",
        "",
        "| policy | engine hit rate | per server | usage cached share | expected = cached | TTFT mean ms | "
        "TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | requests per backend | tenants per backend | errors | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {fmt(r['hit_rate'], '.1%')} | "
            f"{', '.join(fmt(x, '.1%') for x in r['per_server_hit_rate'])} | {fmt(r['usage_cached_share'], '.1%')} | "
            f"{fmt(r.get('prediction_exact_share', float('nan')), '.1%')} | "
            f"{fmt(r['ttft_mean_ms'], '.0f')} | {fmt(r['ttft_p50_ms'], '.0f')} | "
            f"{fmt(pct(r['ttfts_ms'], 90), '.0f')} | {fmt(r['ttft_p99_ms'], '.0f')} | "
            f"{', '.join(f'{k}={v}' for k, v in sorted(r['requests_per_backend'].items()))} | "
            f"{', '.join(f'{k}={v}' for k, v in sorted(r['tenants_per_backend'].items()))} | {r['errors']} | "
            f"{r['wall_s']:.0f} |")
    if tokenize:
        lines += ["", f"Tokenization with the tiny model's tokenizer (the `+events` arm), per request, measured on the "
                  f"same {len(rows[0]['ttfts_ms']) if rows else 0} requests in the same order in the benchmark process "
                  f"(same code, same segment cache): mean {tokenize['tokenize_us_mean']:.0f} µs, p50 "
                  f"{tokenize['tokenize_us_p50']:.0f} µs, p99 {tokenize['tokenize_us_p99']:.0f} µs; the first 10% of "
                  f"requests (cold cache) {tokenize['tokenize_us_first10pct_mean']:.0f} µs on average."]
    for r in rows:
        for i, kv in enumerate(r.get("kv_events") or []):
            if kv:
                lines.append(f"- `{r['policy']}` vllm-{i} events: {kv['state']} ({kv['reason']}), {kv['batches']} "
                             f"batches, resets {kv['resets'] or 'none'}, predictions exact {kv['predictions_exact']}/"
                             f"{kv['predictions_checked']}")
    lines += [
        "",
        "| target | measured | result |",
        "|---|---|---|",
        *targets,
        "",
        "![TTFT CDF](real_vllm_ttft.png)",
        "",
        *([args.note, ""] if args.note else []),
    ]
    (out / "real_vllm.md").write_text("\n".join(lines))
    (out / "real_vllm.json").write_bytes(orjson.dumps(to_jsonable({"rows": rows, "ratio": ratio,
                                                                   "tokenize": tokenize}),
                                                      option=orjson.OPT_INDENT_2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        for r in rows:
            xs = sorted(r["ttfts_ms"])
            a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["policy"])
        a.set_xscale("log")
        a.set_xlabel("TTFT (ms, wall)")
        a.set_ylabel("CDF")
        a.legend()
        a.set_title("real vLLM: TTFT")
        b.bar([r["policy"] for r in rows], [r["hit_rate"] for r in rows])
        b.set_ylabel("vLLM prefix-cache hit rate")
        b.set_title(f"hit rate (ratio {ratio:.2f}x)")
        fig.tight_layout()
        fig.savefig(out / "real_vllm_ttft.png", dpi=110)
        plt.close(fig)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    return passed


def run(args: argparse.Namespace, argv: list[str]) -> int:
    argv = argv[1:] if argv[:1] == ["real-vllm"] else argv  # called as `python -m bench real-vllm ...`
    if args.report_only:
        data = orjson.loads((args.out / "real_vllm.json").read_bytes())
        return 0 if write_report(data["rows"], args, [a for a in argv if a != "--report-only"], args.out,
                                 data.get("tokenize")) else 1
    subprocess.run(["bash", str(SETUP)], check=True, capture_output=True)
    reqs = workload(args)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="real-vllm-") as d:
        for policy in args.policies.split(","):
            print(f"[real_vllm] {policy}: starting two vLLM servers ...", flush=True)
            row = asyncio.run(run_policy(policy, reqs, args, Path(d)))
            print(f"[real_vllm] {policy}: hit rate {row['hit_rate']:.1%}, TTFT p50 {row['ttft_p50_ms']:.0f} ms "
                  f"p99 {row['ttft_p99_ms']:.0f} ms, {row['errors']} errors, {row['wall_s']:.0f} s", flush=True)
            rows.append(row)
    tokenize = tokenization_cost(reqs) if any(p.endswith("+events") for p in args.policies.split(",")) else None
    passed = write_report(rows, args, argv, args.out, tokenize)
    print((args.out / "real_vllm.md").read_text())
    return 0 if passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    return standalone("python -m bench.real_vllm", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
