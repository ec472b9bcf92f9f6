"""Microbenchmark of one routing decision: 16 backends, 10k cached prefixes, 4k-char prompts.

Measures `decide` (the proxy's per-attempt call: SLA screen when needed + policy.choose) per policy
and prompt case, `describe` (once per request), and what the proxy does around a decision (building
the 16 frozen backend views of a snapshot), each as the median and p99 of `--iterations` timed calls.

    ./.venv/bin/python bench/routing_micro.py                       # print one run
    ./.venv/bin/python bench/routing_micro.py --repeats 5 --report  # 5 fresh processes, medians -> results/
    ./.venv/bin/python bench/routing_micro.py --repeats 5 --report --baseline-tree /tmp/old-checkout

Every repeat is a fresh process; with `--baseline-tree` the same script also runs against another
checkout's `gateway` package (PYTHONPATH), alternating with this one, so both see the same machine
noise. The machine is shared: compare medians over repeats, not single runs. Only the standard
library and `gateway`/`backends` are imported, so the script runs against any checkout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BACKENDS = 16
PREFIXES = 10_000
PROMPT_CHARS = 4096
ITERATIONS = 20_000
TARGET_US = 50.0
CASES = {
    "hit": "a tenant prefix 2 backends hold",
    "hot-all": "a hot tenant prefix all 16 backends hold (every holder is searched)",
    "miss": "a prefix nobody holds (rendezvous placement)",
    "hit+sla": "'hit' with x-sla-ttft-ms and x-sla-tpot-ms (SLA screen of all 16 first)",
    "hot+sla": "'hot-all' with both SLA headers: the worst case",
    "...+events": "the same with the request's token ids and all 16 backends' KV events live (exact hits from "
                  "each backend's event-built index, which holds the same 10k prompts' blocks)",
}


def _text(rng: random.Random, n: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
    out = []
    size = 0
    while size < n:
        w = rng.choice(words) + str(rng.randrange(1000))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def _body(tenant: str, question: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": tenant}, {"role": "user", "content": question}]}


def _measure(fn: Callable[[], object], iterations: int) -> tuple[float, float]:
    samples = []
    clock = time.perf_counter_ns
    for _ in range(iterations):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    samples.sort()
    return statistics.median(samples) / 1000, samples[int(len(samples) * 0.99)] / 1000


def _engine_holds(caches: Any, backend: str, body: dict[str, object], block_size: int, tokenizer: Any) -> None:
    """`backend`'s engine published that it stored `body`'s prompt (all its full blocks)."""
    from backends.base import Endpoint
    from gateway.kvcache.events import Batch, Stored
    from gateway.routing.tokens import TokenPrompt

    prompt = tokenizer.prompt(body, Endpoint.CHAT)
    ids = prompt.ids()
    n = len(ids) // block_size
    keys = TokenPrompt([*ids, 0]).keys(block_size)[:n]  # the engine's own hashes: any distinct ints do
    cache = caches.add(backend)
    seq = cache.ranks[0].next_seq if cache.ranks else 0
    cache.receive(Batch(seq, 0.0, 0, (Stored(keys, None, tuple(ids[: n * block_size]), block_size),)), 0.0)


def run_once(iterations: int) -> dict[str, Any]:
    """One measurement in this process: {name: [median_us, p99_us]} plus the setup it measured."""
    from backends.base import Endpoint, Runtime
    from gateway.routing import POLICIES, BackendView, RouteRequest, RoutingState, Snapshot, decide, describe

    try:  # a checkout without KV events (`--baseline-tree`) measures the cases it has
        from gateway.kvcache import KvCaches
        from gateway.tokenize import load
    except ImportError:
        KvCaches = None  # type: ignore[misc,assignment]
    rng = random.Random(0)
    caches = KvCaches(clock=lambda: 0.0) if KvCaches is not None else None
    tokenizer = load("emulator") if caches is not None else None
    state = RoutingState(capacity=100_000, engines=caches) if caches is not None else RoutingState(capacity=100_000)

    def make_views() -> tuple[BackendView, ...]:
        r = random.Random(1)
        return tuple(
            BackendView(
                name=f"b{i:02d}", runtime=Runtime.VLLM, healthy=True, in_flight=r.randrange(8), waiting=r.randrange(3),
                running=r.randrange(16), kv_usage=0.5, usd_per_hour=2.0 + i % 4,
                block_size=(16, 32, 64, 128)[i % 4], output_tokens_per_s=500.0 + 50 * i,
            )
            for i in range(BACKENDS)
        )

    views = make_views()
    fields = [(v.name, v.runtime, v.healthy, v.in_flight, v.waiting, v.running, v.kv_usage, v.usd_per_hour,
               v.block_size, v.output_tokens_per_s) for v in views]

    def pool_snapshot() -> Snapshot:  # what `Pool.snapshot` + `RoutingState.snapshot` build per attempt
        return state.snapshot(Snapshot(tuple([BackendView(*f) for f in fields])))

    tenants = [_text(rng, 3000) for _ in range(200)]
    # 10k distinct cached prompts spread over the backends (each ~64 blocks deep).
    for n in range(PREFIXES):
        body = _body(tenants[n % len(tenants)], _text(rng, 1000))
        feats = describe(body, Endpoint.CHAT, {})
        view = views[n % BACKENDS]
        if caches is not None:
            _engine_holds(caches, view.name, body, view.block_size or 16, tokenizer)
        ticket = state.dispatched(view, feats)
        state.completed(ticket, cached_tokens=None, prompt_tokens=None, itl_s=0.02)
        state.first_token(ticket, 0.1)
    for view in views:
        for _ in range(3):
            state.observe(view.name, work_tokens=2000, ttft_s=0.2, running=8, itl_s=0.02)
    # Worst case: one hot tenant whose 3k-char prefix every backend holds (spilled everywhere).
    hot_tenant = tenants[0]
    for view in views:
        body = _body(hot_tenant, _text(rng, 1000))
        if caches is not None:
            _engine_holds(caches, view.name, body, view.block_size or 16, tokenizer)
        state.dispatched(view, describe(body, Endpoint.CHAT, {}))
    snap = state.snapshot(Snapshot(views))
    out: dict[str, Any] = {"entries_per_backend": state.index.size("b00"), "timings": {}}
    timings: dict[str, list[float]] = out["timings"]

    hit_body = _body(tenants[7], _text(rng, PROMPT_CHARS - 3000))  # shared tenant prefix: 2 holders
    miss_body = _body(_text(rng, 3000), _text(rng, PROMPT_CHARS - 3000))  # nobody has it
    for label, body in (("hit", hit_body), ("miss", miss_body)):
        timings[f"describe {label}"] = list(_measure(lambda b=body: describe(b, Endpoint.CHAT, {}), iterations // 4))  # type: ignore[misc]
    # What the proxy adds per decision: the pool's frozen views and the routing state's snapshot.
    timings["snapshot (16 views)"] = list(_measure(pool_snapshot, iterations // 4))
    sla_headers = {"x-sla-ttft-ms": "500", "x-sla-tpot-ms": "50"}
    hot_body = _body(hot_tenant, _text(rng, PROMPT_CHARS - 3000))
    cases = {
        "hit": describe(hit_body, Endpoint.CHAT, {}),
        "hot-all": describe(hot_body, Endpoint.CHAT, {}),
        "miss": describe(miss_body, Endpoint.CHAT, {}),
        "hit+sla": describe(hit_body, Endpoint.CHAT, sla_headers),
        "hot+sla": describe(hot_body, Endpoint.CHAT, sla_headers),
    }
    if caches is not None and tokenizer is not None:
        names = [v.name for v in views]

        def tokenize(body: dict[str, object]) -> object:
            """What the proxy adds per request with a tokenizer: the token ids and their block keys."""
            prompt = tokenizer.prompt(body, Endpoint.CHAT)
            state.prepare(describe(body, Endpoint.CHAT, {}, tokens=prompt), names)
            return prompt

        for label, body in (("hit", hit_body), ("miss", miss_body)):
            timings[f"tokenize+keys {label} (segments cached)"] = list(
                _measure(lambda b=body: tokenize(b), iterations // 4))  # type: ignore[misc]
        fresh = [_body(tenants[3], _text(rng, PROMPT_CHARS - 3000)) for _ in range(iterations // 8)]
        it = iter(fresh)
        timings["tokenize+keys new question (one new segment)"] = list(
            _measure(lambda: tokenize(next(it)), len(fresh)))
        with_tokens = {}
        for label, body, headers in (("hit", hit_body, {}), ("hot-all", hot_body, {}), ("miss", miss_body, {}),
                                     ("hit+sla", hit_body, sla_headers), ("hot+sla", hot_body, sla_headers)):
            prompt = tokenizer.prompt(body, Endpoint.CHAT)
            feats = describe(body, Endpoint.CHAT, headers, tokens=prompt)
            state.prepare(feats, names)
            with_tokens[f"{label}+events"] = feats
        live = sum(1 for c in caches if c.live)
        out["live_caches"] = live
        out["blocks_per_cache"] = len(next(iter(caches)).ranks[0].index)
        cases.update(with_tokens)
    for name, policy in POLICIES.items():
        for label, feats in cases.items():
            req = RouteRequest("m", 1, features=feats)
            fn = lambda p=policy, r=req: decide(p, r, snap, rng)  # noqa: E731
            timings[f"decide {name} {label}"] = list(_measure(fn, iterations))
    return out


def _subprocess(tree: Path | None, iterations: int) -> dict[str, Any]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)  # ahead of the installed checkout (the script's own dir comes first)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--raw", "--iterations", str(iterations)]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _median(runs: list[dict[str, Any]], name: str, i: int) -> float:
    """NaN when the runs did not measure `name` (a baseline checkout without that case)."""
    if not runs or any(name not in r["timings"] for r in runs):
        return float("nan")
    return float(statistics.median(float(r["timings"][name][i]) for r in runs))


def report(current: list[dict[str, Any]], baseline: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    names = list(current[0]["timings"])
    decide_names = [n for n in names if n.startswith("decide ")]
    event_names = [n for n in decide_names if n.endswith("+events")]
    worst = max(decide_names, key=lambda n: _median(current, n, 0))
    lines = [
        "# Routing decision cost (microbenchmark)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}; commit `{rev.strip()}` + working tree; "
        f"machine: {platform.node()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}",
        f"- command: `python bench/routing_micro.py {' '.join(sys.argv[1:])}`",
        f"- setup: {BACKENDS} backends (block sizes 16/32/64/128, random in-flight and queue), {PREFIXES} cached "
        f"prompts of ~4k chars ({current[0]['entries_per_backend']} index entries per backend), latency models "
        f"learned for every backend, {PROMPT_CHARS}-char prompts; `decide` is timed {args.iterations} times per "
        "case (`describe` and the snapshot a quarter as often)",
        f"- statistics: each repeat is a fresh process; a cell is the median over {len(current)} repeats of that "
        "repeat's median (or p99) in microseconds"
        + (f"; 'before' ran the same script against `{args.baseline_tree}`"
           + (f" ({args.baseline_label})" if args.baseline_label else "") + " alternately with 'after'"
           if baseline else ""),
        "- cases: " + "; ".join(f"`{k}` = {v}" for k, v in CASES.items()),
        f"- target: a decision under {TARGET_US:.0f} µs; worst case now: `{worst}` at "
        f"{_median(current, worst, 0):.1f} µs median"
        + (f"; with KV events (exact hits on all 16 backends, {current[0].get('blocks_per_cache')} blocks in each "
           f"backend's event-built index): worst `{max(event_names, key=lambda n: _median(current, n, 0))}` at "
           f"{max(_median(current, n, 0) for n in event_names):.1f} µs" if event_names else ""),
        "",
    ]
    if baseline:
        lines += ["| measured | before median µs | before p99 µs | after median µs | after p99 µs | speed-up |",
                  "|---|---|---|---|---|---|"]
        for n in names:
            b, a = _median(baseline, n, 0), _median(current, n, 0)
            cells = f"{b:.1f} | {_median(baseline, n, 1):.1f}" if b == b else "- | -"
            ratio = f"{b / a:.2f}x" if b == b else "new"
            lines.append(f"| {n} | {cells} | {a:.1f} | {_median(current, n, 1):.1f} | {ratio} |")
    else:
        lines += ["| measured | median µs | p99 µs |", "|---|---|---|"]
        lines += [f"| {n} | {_median(current, n, 0):.1f} | {_median(current, n, 1):.1f} |" for n in names]
    lines += ["", "`snapshot (16 views)` is not part of `decide`: it is what the proxy spends building the frozen "
              "views a decision reads, listed so the whole per-attempt routing cost is visible.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=ITERATIONS)
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per tree (medians over them)")
    p.add_argument("--baseline-tree", type=Path, help="another checkout to measure alternately ('before')")
    p.add_argument("--baseline-label", default="", help="what the baseline tree is, for the report")
    p.add_argument("--report", action="store_true", help="write results/routing_micro.md and .json")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)  # one run, JSON on stdout
    args = p.parse_args()
    if args.raw:
        print(json.dumps(run_once(args.iterations)))
        return
    current: list[dict[str, Any]] = []
    baseline: list[dict[str, Any]] = []
    for r in range(args.repeats):
        if args.baseline_tree is not None:
            baseline.append(_subprocess(args.baseline_tree, args.iterations))
        current.append(_subprocess(None, args.iterations))
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    if args.report:  # the raw runs first: nothing measured is lost to a formatting error
        args.out.mkdir(parents=True, exist_ok=True)
        raw = {"current": current, "baseline": baseline, "baseline_tree": str(args.baseline_tree or "")}
        (args.out / "routing_micro.json").write_text(json.dumps(raw, indent=1))
    for n in current[0]["timings"]:
        before = f"before {_median(baseline, n, 0):5.1f} us -> " if baseline else ""
        print(f"{n:34s}: {before}median {_median(current, n, 0):5.1f} us, p99 {_median(current, n, 1):5.1f} us")
    if args.report:
        (args.out / "routing_micro.md").write_text(report(current, baseline, args))
        print(f"wrote {args.out / 'routing_micro.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
