"""Multi-turn routing evaluation: prefix reuse vs a single infinite cache, and TTFT, on one workload.

    python -m bench multiturn [--quick] [--variants a,b,...] [--speed X] [--requests N] [--baseline-rev REV]

The workload (`multiturn_workload.py`): 16 tenants, conversations of 4-8 turns resending the whole
history, 10% RAG, arrivals calibrated to ~70% prefill load (what a single infinite cache would still
prefill, over the fleet's prefill rate), over 4 emulated vLLM backends (DeepSeek-V3 on 8xH200
profile, 64-token blocks) whose caches together hold 1.5x the working set (one backend: 37.5%).
A conversation's next turn is sent once its previous turn has answered (plus a short think time).

Variants, each on a FRESH fleet process and a FRESH router process, the same requests:

* `reference`: the whole workload on ONE backend with an infinite KV cache at the same per-backend
  load (arrivals 4x slower, speed 4x higher: the same wall time): the reuse every ratio is against;
* `round_robin`: the gateway's round robin;
* `affinity@main`: the gateway's `prefix_affinity` as of `--baseline-rev` (default: the commit this
  branch started from), run from a `git archive` of that commit;
* `affinity`: `prefix_affinity` of this tree, without events and without a tokenizer;
* `affinity+events`: the same with `tokenizer: emulator` and every backend's KV events;
* `sglang-cache_aware`: sglang-router (PyPI, its own venv in ~/.cache/igw/peers) `--policy cache_aware`.

Reuse = the engines' own `vllm:prefix_cache_hits_total / queries_total` summed over the fleet;
TTFT is client-measured and reported in simulated seconds (wall x speed). For the gateway variants
the share of responses whose `x-gateway-expected-cached-tokens` equalled the engine's
`cached_tokens` is reported too. Results: bench/results/multiturn.md, .json, multiturn.png.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench.cli import standalone
from bench.multiturn_workload import Ideal, MultiTurnSpec, calibrate, generate, ideal
from bench.peers import PEERS_DIR, SGLANG_ROUTER, install, version
from bench.procs import ROOT, Proc, free_port
from bench.routing_client import Result, fmt, hit_counters, pct, scrape, stream_one, to_jsonable
from bench.routing_fleet import BackendSpec
from bench.routing_run import Fleet
from bench.workload import TimedRequest

RESULTS = ROOT / "bench" / "results"
PROFILE = "deepseek-v3-8xh200"
BLOCK = 64  # the profile's vLLM block size (MLA)
PREFILL_TOKENS_PER_S = 15_000.0  # the profile's vLLM prefill rate
BACKENDS = 4
INFINITE_KV = 10**9
THINK_S = 0.05  # simulated seconds between a turn's answer and the next turn, at least
VARIANTS = ("reference", "round_robin", "affinity@main", "affinity", "affinity+events", "sglang-cache_aware")
BASE_REV = "fd6fd13"  # main when this benchmark was written: today's prefix_affinity


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="1,000 requests (about 5 minutes)")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--speed", type=float, default=None, help="emulator speed (simulated s per wall s)")
    p.add_argument("--load", type=float, default=0.7)
    p.add_argument("--cache-factor", type=float, default=1.5, help="fleet KV / working set")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--baseline-rev", default=BASE_REV)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--report-only", action="store_true", help="re-render the report from multiturn.json")


@dataclass(frozen=True, slots=True)
class Setup:
    spec: MultiTurnSpec
    speed: float
    load: float
    cache_factor: float
    kv_tokens: int  # per backend
    rate_rps: float  # simulated
    ideal: Ideal


# --- processes --------------------------------------------------------------------------------


def baseline_tree(rev: str, tmp: Path) -> Path:
    """`gateway` and `backends` as of `rev` (git archive), to run today's policy side by side."""
    dest = tmp / f"baseline-{rev}"
    if not dest.exists():
        archive = tmp / f"baseline-{rev}.tar"
        subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), rev, "gateway", "backends"],
                       cwd=ROOT, check=True)
        dest.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    return dest


class Router:
    """A router process in front of the fleet: the gateway (this tree or a baseline) or a peer."""

    def __init__(self, variant: str, fleet: Fleet, kv_ports: Sequence[int], tmp: Path, tag: str,
                 baseline: Path | None) -> None:
        self.variant = variant
        self.model = "moe"
        if variant.startswith("sglang"):
            why = install(SGLANG_ROUTER)
            if why is not None:
                raise RuntimeError(f"sglang-router unavailable: {why}")
            port = free_port()
            argv = [str(PEERS_DIR / "sglang-router" / "bin" / "python"), "-m", "sglang_router.launch_router",
                    "--worker-urls", *fleet.urls.values(), "--host", "127.0.0.1", "--port", str(port),
                    "--policy", "cache_aware", "--log-level", "warn"]
            self.proc = Proc(f"router-{tag}", argv, log=tmp / f"router-{tag}.log")
            self.url = f"http://127.0.0.1:{port}"
            self.model = "moe-model"
            self.argv = " ".join(argv[1:]).replace(str(PEERS_DIR), "~/.cache/igw/peers")
            return
        names = list(fleet.urls)
        policy = "round_robin" if variant in ("reference", "round_robin") else "prefix_affinity"
        backends: list[dict[str, Any]] = [{"name": n, "runtime": "vllm", "url": fleet.urls[n], "model": "moe-model"}
                                          for n in names]
        route: dict[str, Any] = {"model": "moe", "backends": names, "policy": policy}
        if variant == "affinity+events":
            route["tokenizer"] = "emulator"
            for b, port in zip(backends, kv_ports, strict=True):
                b["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{port}", "bind": True}
        config = {"listen": {"host": "127.0.0.1", "port": 0}, "backends": backends, "routes": [route],
                  "health": {"interval_s": 0.5}, "timeouts": {"first_token_s": 300, "total_s": 900}}
        path = tmp / f"gateway-{tag}.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", "0",
                "--log-level", "WARNING"]
        self.proc = Proc(f"gateway-{tag}", argv, log=tmp / f"gateway-{tag}.log", stdout_pipe=True,
                         cwd=baseline or ROOT, env={"PYTHONPATH": str(baseline)} if baseline else None)
        self.url = self.proc.read_line("gateway listening on ").split()[-1]
        self.argv = f"gateway serve (policy {policy}{', tokenizer emulator, kv_events' if 'events' in variant else ''})"

    async def ready(self, timeout_s: float = 90.0) -> None:
        """Gateway: every backend scraped once (block size known). Peer: it answers a chat request."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.proc.poll() is not None:
                    raise RuntimeError(f"{self.variant} exited: {self.proc.log_path.read_text()[-2000:]}")
                try:
                    if self.variant.startswith("sglang"):
                        body = {"model": self.model, "messages": [{"role": "user", "content": "ready?"}],
                                "max_tokens": 1}
                        async with http.post(self.url + "/v1/chat/completions", json=body,
                                             timeout=aiohttp.ClientTimeout(total=5)) as r:
                            if r.status == 200:
                                return
                    else:
                        async with http.get(self.url + "/admin/backends", timeout=aiohttp.ClientTimeout(total=5)) as r:
                            body = await r.json()
                        if all(b["healthy"] and b["load"]["block_size"] for b in body["backends"]):
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError(f"{self.variant} not ready after {timeout_s} s")

    def stop(self) -> None:
        self.proc.stop()


# --- replay -------------------------------------------------------------------------------------


async def replay(url: str, requests: Sequence[TimedRequest], *, speed: float, model: str,
                 on_done: Callable[[Result], None] | None = None) -> list[Result]:
    """Open-loop arrivals, except that a conversation's next turn waits for its previous turn's
    answer (plus THINK_S): a client cannot send the history before it has the answer."""
    conn = aiohttp.TCPConnector(limit=4096, limit_per_host=4096)
    async with aiohttp.ClientSession(connector=conn) as http:
        start = time.perf_counter()
        last: dict[str, asyncio.Task[Result]] = {}

        async def one(i: int, req: TimedRequest, before: asyncio.Task[Result] | None) -> Result:
            due = start + req.at_s / speed
            if before is not None:
                await asyncio.shield(before)
                due = max(due, time.perf_counter() + THINK_S / speed)
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            r = await stream_one(http, url, req, i, model=model, timeout_s=900)
            r.late_s = max(0.0, time.perf_counter() - due - (r.e2e_s or 0.0))
            if on_done is not None:
                on_done(r)
            return r

        tasks = []
        for i, req in enumerate(requests):
            task = asyncio.create_task(one(i, req, last.get(req.session) if req.session else None))
            if req.session:
                last[req.session] = task
            tasks.append(task)
        return list(await asyncio.gather(*tasks))


async def run_variant(variant: str, setup: Setup, requests: list[TimedRequest], tmp: Path, tag: str,
                      baseline: Path | None, progress: Callable[[int, int], None]) -> dict[str, Any]:
    reference = variant == "reference"
    n = 1 if reference else BACKENDS
    speed = setup.speed * (BACKENDS if reference else 1)
    reqs = [replace(r, at_s=r.at_s * BACKENDS) for r in requests] if reference else requests
    kv_ports = [free_port() for _ in range(n)]
    events = variant == "affinity+events"
    specs = [BackendSpec(f"b{i}", PROFILE, "vllm", speed, INFINITE_KV if reference else setup.kv_tokens,
                         kv_events=f"tcp://127.0.0.1:{kv_ports[i]}") for i in range(n)]
    fleet = Fleet(specs, tmp, tag)
    router: Router | None = None
    try:
        router = Router(variant, fleet, kv_ports, tmp, tag, baseline if variant.endswith("@main") else None)
        await router.ready()
        async with aiohttp.ClientSession() as http:
            scraped = {b: await scrape(http, u + "/metrics") for b, u in fleet.urls.items()}
        before = {b: hit_counters(m) for b, m in scraped.items()}
        served_before = {b: m.get("vllm:request_success_total", 0.0) for b, m in scraped.items()}
        done = 0

        def tick(_: Result) -> None:
            nonlocal done
            done += 1
            progress(done, len(reqs))

        t0 = time.perf_counter()
        results = await replay(router.url, reqs, speed=speed, model=router.model, on_done=tick)
        wall = time.perf_counter() - t0
        async with aiohttp.ClientSession() as http:
            scraped = {b: await scrape(http, u + "/metrics") for b, u in fleet.urls.items()}
            kv: list[Any] = []
            if events:
                async with http.get(router.url + "/admin/backends") as r:
                    kv = [b["kv_events"] for b in (await r.json())["backends"]]
        after = {b: hit_counters(m) for b, m in scraped.items()}
        served = {b: m.get("vllm:request_success_total", 0.0) - served_before[b] for b, m in scraped.items()}
        hits = sum(after[b][0] - before[b][0] for b in fleet.urls)
        queries = sum(after[b][1] - before[b][1] for b in fleet.urls)
        return reduce(variant, results, hits, queries, speed, wall, router.argv, kv, served)
    finally:
        if router is not None:
            router.stop()
        fleet.stop()


def reduce(variant: str, results: list[Result], hits: float, queries: float, speed: float, wall: float,
           argv: str, kv: list[Any], engine_requests: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and not r.error]
    ttft = [r.ttft_s * speed for r in ok if r.ttft_s is not None]
    by_backend: dict[str, int] = {}
    for r in ok:
        by_backend[r.backend] = by_backend.get(r.backend, 0) + 1
    predicted = [r for r in ok if r.expected_cached is not None]
    exact = sum(1 for r in predicted if r.expected_cached == r.cached_tokens)
    sessions: dict[str, set[str]] = {}
    reasons: dict[str, int] = {}
    moves: dict[str, int] = {}  # why a conversation's turn went to another backend than its previous turn
    previous: dict[str, str] = {}
    for r in sorted(ok, key=lambda x: x.index):
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
        if r.session:
            sessions.setdefault(r.session, set()).add(r.backend)
            if r.session in previous and previous[r.session] != r.backend:
                moves[r.reason] = moves.get(r.reason, 0) + 1
            previous[r.session] = r.backend
    errors = [abs(r.expected_cached - r.cached_tokens) for r in ok if r.expected_cached is not None]
    timed = sorted((r for r in ok if r.ttft_s is not None), key=lambda r: -(r.ttft_s or 0.0))
    slowest = timed[: max(1, len(ok) // 100)]
    tail = [{"ttft_ms": round((r.ttft_s or 0.0) * speed * 1000), "kind": r.kind, "prompt": r.prompt_tokens,
             "cached": r.cached_tokens, "backend": r.backend, "reason": r.reason} for r in slowest]
    return {
        "variant": variant, "router": argv, "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error or str(r.status) for r in results if r not in ok})[:3],
        "hit_rate": hits / queries if queries else math.nan, "hits": hits, "queries": queries,
        "usage_cached_share": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else math.nan,
        "requests_per_backend": by_backend,
        "conversations_split": sum(1 for b in sessions.values() if len(b) > 1) / max(1, len(sessions)),
        "turn_moves": sum(moves.values()), "moves_by_reason": moves, "reasons": reasons,
        "prediction_error_p50": pct(errors, 50), "prediction_error_p99": pct(errors, 99),
        "prediction_error_mean": sum(errors) / len(errors) if errors else math.nan,
        "prediction_exact_share": exact / len(predicted) if predicted else math.nan,
        "predictions": len(predicted),
        "client_late_p99_s": pct([r.late_s * speed for r in results], 99),
        "wall_s": wall, "speed": speed, "kv_events": kv, "ttfts_s": ttft, "slowest_1pct": tail,
        "engine_requests": engine_requests,
    }


# --- report -------------------------------------------------------------------------------------


def write_report(data: dict[str, Any], out: Path, argv: list[str]) -> None:
    rows = data["rows"]
    setup = data["setup"]
    ref = next((r for r in rows if r["variant"] == "reference"), None)
    ref_hit = ref["hit_rate"] if ref else math.nan
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    spec = setup["spec"]
    ideal_share = setup["ideal"]["cached_tokens"] / setup["ideal"]["prompt_tokens"]
    lines = [
        "# Multi-turn routing: prefix reuse against a single infinite cache",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}; commit `{rev.strip()}` + working tree; "
        f"machine: {platform.node()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}",
        f"- command: `python -m bench multiturn {' '.join(argv)}`",
        f"- workload: {spec['requests']} requests, {spec['tenants']} tenants (system prompts "
        f"{spec['system_tokens'][0]}-{spec['system_tokens'][1]} tokens), conversations of {spec['turns'][0]}-"
        f"{spec['turns'][1]} turns resending the whole history ({spec['active_sessions']} live at a time), "
        f"{spec['rag_share']:.0%} RAG over {spec['docs']} documents ({spec['doc_tokens'][0]}-{spec['doc_tokens'][1]} "
        f"tokens, Zipf); mean prompt {setup['ideal']['prompt_tokens'] / spec['requests']:.0f} tokens",
        f"- fleet: {BACKENDS} emulated vLLM backends, profile `{PROFILE}` ({BLOCK}-token blocks, "
        f"{PREFILL_TOKENS_PER_S:.0f} prefill tokens/s each), KV {setup['kv_tokens']} tokens each: the fleet holds "
        f"{setup['cache_factor']:.2f}x the working set of {setup['ideal']['working_set_tokens']} tokens (one backend "
        f"{setup['cache_factor'] / BACKENDS:.1%} of it)",
        f"- load: {setup['rate_rps']:.0f} requests/s (simulated), so that what a single infinite cache would still "
        f"prefill is {setup['load']:.0%} of the fleet's prefill rate; emulators at speed {setup['speed']} (TTFT in "
        f"simulated seconds = wall x speed); a conversation's next turn waits for its previous answer",
        f"- ideal: one infinite cache reuses {ideal_share:.1%} of prompt tokens (computed); the `reference` run "
        "measures it on one emulated engine",
        "",
        "| variant | engine hit rate | of reference | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | conversations split | "
        "expected = reported | requests per backend | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = r["hit_rate"] / ref_hit if ref_hit and not math.isnan(ref_hit) else math.nan
        # a round_robin route reads no prefix index, so it predicts nothing (the header says 0)
        exact = "n/a" if "policy round_robin" in r["router"] else fmt(r["prediction_exact_share"], ".1%")
        lines.append(
            f"| {r['variant']} | {fmt(r['hit_rate'], '.1%')} | {fmt(share, '.1%')} | "
            f"{fmt(r['ttft_p50_s'] * 1000, '.0f')} | {fmt(r['ttft_p90_s'] * 1000, '.0f')} | "
            f"{fmt(r['ttft_p99_s'] * 1000, '.0f')} | "
            f"{fmt(r['conversations_split'], '.1%')} | {exact} | "
            f"{', '.join(f'{k}={v}' for k, v in sorted(r['requests_per_backend'].items()))} | {r['errors']} |")
    lines += ["", "`expected = reported`: the share of responses whose `x-gateway-expected-cached-tokens` equalled the "
              "engine's `cached_tokens` (n/a for round_robin routes, which read no prefix index and expect 0)."]
    lines += ["", "Routers: " + "; ".join(f"`{r['variant']}`: {r['router']}" for r in rows), ""]
    lines += [*data.get("notes", []), "", "![multi-turn](multiturn.png)", ""]
    (out / "multiturn.md").write_text("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
        names = [r["variant"] for r in rows]
        shares = [r["hit_rate"] / ref_hit * 100 if ref_hit and not math.isnan(ref_hit) else r["hit_rate"] * 100
                  for r in rows]
        a.barh(names, shares, color="#4c72b0")
        a.set_xlim(max(0.0, min(shares) - 5) if shares else 0, 101)
        a.set_xlabel("engine prefix reuse, % of the single infinite cache")
        for i, v in enumerate(shares):
            a.text(v, i, f" {v:.1f}%", va="center")
        a.invert_yaxis()
        for r in rows:
            xs = sorted(t * 1000 for t in r["ttfts_s"])
            if xs:
                b.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["variant"])
        b.set_xscale("log")
        b.set_xlabel("TTFT, simulated ms")
        b.set_ylabel("CDF")
        b.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "multiturn.png", dpi=110)
        plt.close(fig)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    argv = argv[1:] if argv[:1] == ["multiturn"] else argv
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        data = orjson.loads((args.out / "multiturn.json").read_bytes())
        write_report(data, args.out, [a for a in argv if a != "--report-only"])
        return 0
    n = args.requests or (1000 if args.quick else 3000)
    spec = MultiTurnSpec(requests=n, active_sessions=96 if args.quick else 160)
    print(f"[multiturn] generating {n} requests and the ideal cache ...", flush=True)
    reqs = generate(spec)
    best = ideal(reqs, BLOCK)
    reqs, rate = calibrate(reqs, best, load=args.load, fleet_prefill_tokens_per_s=BACKENDS * PREFILL_TOKENS_PER_S)
    kv_tokens = int(args.cache_factor * best.working_set_tokens / BACKENDS) // BLOCK * BLOCK
    speed = args.speed or 0.15
    setup = Setup(spec, speed, args.load, args.cache_factor, kv_tokens, rate, best)
    print(f"[multiturn] {rate:.0f} req/s simulated ({rate * speed:.0f} wall), working set {best.working_set_tokens} "
          f"tokens, KV {kv_tokens} per backend, ideal hit rate {best.hit_rate:.1%}", flush=True)
    variants = args.variants.split(",")
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    (RESULTS / "tmp").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="multiturn-", dir=RESULTS / "tmp") as d:
        tmp = Path(d)
        baseline = baseline_tree(args.baseline_rev, tmp) if any(v.endswith("@main") for v in variants) else None
        for rep in range(args.repeats):
            for v in variants:
                tag = f"{v.replace('@', '-').replace('+', '-')}-{rep}"
                t0 = time.monotonic()

                def progress(done: int, total: int, v: str = v) -> None:
                    if done % 250 == 0 or done == total:
                        print(f"  {v}: {done}/{total}", flush=True)

                try:
                    row = asyncio.run(run_variant(v, setup, reqs, tmp, tag, baseline, progress))
                except RuntimeError as exc:
                    notes.append(f"- {v} skipped: {exc}")
                    print(f"[multiturn] {v} skipped: {exc}", flush=True)
                    continue
                row["repeat"] = rep
                rows.append(row)
                print(f"[multiturn] {v}: hit rate {row['hit_rate']:.1%}, TTFT p50 {row['ttft_p50_s'] * 1000:.0f} ms "
                      f"p99 {row['ttft_p99_s'] * 1000:.0f} ms, exact {fmt(row['prediction_exact_share'], '.1%')}, "
                      f"{row['errors']} errors, {time.monotonic() - t0:.0f} s", flush=True)
    if any(r["variant"].startswith("sglang") for r in rows):
        notes.append(f"- sglang-router {version(SGLANG_ROUTER)} from PyPI, its defaults (cache threshold 0.3, "
                     "balance thresholds 64 / 1.5, tree of 64M characters)")
    if baseline is not None:
        notes.append(f"- `affinity@main` is `git archive {args.baseline_rev}` (gateway, backends), run as pure "
                     "Python (an archive has no compiled modules; routing decisions are the same in both builds)")
    data = {"setup": {**asdict(setup), "spec": asdict(spec), "ideal": asdict(best)}, "rows": rows, "notes": notes}
    (args.out / "multiturn.json").write_bytes(orjson.dumps(to_jsonable(data), option=orjson.OPT_INDENT_2))
    write_report(data, args.out, argv)
    print((args.out / "multiturn.md").read_text())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return standalone("python -m bench.multiturn", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
