"""`python -m bench overhead [--peers] [--only a,b,c] [--rounds N] [--duration S]`: what the gateway
costs over a direct call and over its peers, measured side by side in one run (issue 13).

The load is issue 13's: a 1.2 KB chat request carrying a ~1 KB system prompt (bench/chat_bodies.py),
wrk at c=64, the gateway with one vLLM backend and `policy: round_robin`. Three target measurements,
each over the same set of targets (bench/targets.py: direct, gateway, pure, lean, naive and, with
`--peers`, vllm-router, sglang-router and SMG at pinned versions):

- **a**, non-streaming: nginx serves a canned vLLM chat completion; CPU µs per request.
- **b**, streaming, 20 SSE data events (+ `[DONE]`) that nginx sends in one write; CPU µs per request.
- **c**, streaming with every event in its own write (bench/drip_sse.py: 64 token events, 67 events
  with role, usage and [DONE], 10 ms apart); CPU per relayed chunk beyond the plain relay, the
  target: the marginal cost of one more chunk, from the same targets answering 64 and 256 tokens,
  ((gateway's long − short) − (lean's long − short)) / (events long − short), free of the
  per-request work that a and b measure; also the amortised figure (CPU per response of the gateway
  − of lean) / events per response at 64 tokens.

Rounds are interleaved: round 1 measures every target of a, b and c, round 2 again, ..., each round
with the gateway's comparisons next to it, in an order reversed every other round
(`targets.measuring_order`); figures are medians over rounds and ratios are medians of the per-round
ratios (bench/report.py). The other parts,
run unless `--only` leaves them out: **sweep** (non-streaming at c = 1, 8, 256), **ttft** (time to first
token, sequential), **openloop** (fixed request rates), **profile** (py-spy), **streams** (10,000 slow
concurrent streams through one gateway worker). Results: bench/results/overhead.md (+ .json, PNG plots,
profile.md, profile-overhead.svg).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from bench import chat_bodies, measure, overhead_parts, peers, procs, report, run_info, targets, wrk
from bench.procs import Nginx, PyServer
from bench.targets import Target
from bench.upstream import bodies

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("a", "b", "c", "sweep", "ttft", "openloop", "profile", "streams")
CHAT_BODY = chat_bodies.chat()
STREAM_BODY = chat_bodies.stream(max_tokens=bodies.TOKENS)  # b: nginx's canned 20-event answer
DRIP_TOKENS = 64
DRIP_BODY = chat_bodies.stream(max_tokens=DRIP_TOKENS)  # c (and the slow streams)
DRIP_LONG_TOKENS = 4 * DRIP_TOKENS  # c's second length, asked of the same targets


@dataclass(frozen=True, slots=True)
class Plan:
    rounds: int
    duration_s: float
    sections: tuple[str, ...]
    concurrency: int  # wrk -c for a, b and c
    warmup_s: float
    drip_tokens: int
    drip_long_tokens: int  # c's second length (the marginal cost per chunk)
    drip_gap_ms: float
    sweep_concurrency: tuple[int, ...]
    ttft_n: int
    openloop_fractions: tuple[float, ...]  # of the gateway's c=64 throughput in a
    openloop_s: float
    profile_s: int
    streams_n: int
    streams_events: int
    streams_ramp_s: float


FULL = Plan(rounds=3, duration_s=10, sections=SECTIONS, concurrency=64, warmup_s=2, drip_tokens=DRIP_TOKENS,
            drip_long_tokens=DRIP_LONG_TOKENS,
            drip_gap_ms=10, sweep_concurrency=(1, 8, 256), ttft_n=500, openloop_fractions=(0.25, 0.5),
            openloop_s=10, profile_s=10, streams_n=10_000, streams_events=30, streams_ramp_s=10)
QUICK = replace(FULL, rounds=1, duration_s=2, warmup_s=1, ttft_n=50, openloop_fractions=(0.5,), openloop_s=3,
                profile_s=3, streams_n=1000, streams_events=5, streams_ramp_s=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 2 s per point, small rest")
    parser.add_argument("--peers", action="store_true",
                        help=f"also measure {peers.VLLM_ROUTER.requirement}, {peers.SGLANG_ROUTER.requirement} and "
                             f"{peers.SMG.requirement} "
                             "(installed into ~/.cache/igw/peers/; left out with a note when that fails)")
    parser.add_argument("--litellm", action="store_true",
                        help=f"also measure the LiteLLM proxy ({peers.LITELLM.requirement}; ~100x the routers' "
                             "CPU per request, so it is not in --peers)")
    parser.add_argument("--only", type=_sections, metavar="LIST",
                        help=f"comma-separated parts to run, of {','.join(SECTIONS)} (default: all); "
                             "`--only a,b,c` is the three issue-13 targets")
    parser.add_argument("--baseline", metavar="REV",
                        help="also measure the gateway at commit REV, built the same way (issue 12: no regression "
                             "beyond 5%% CPU per request against the previous commit, side by side)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3, quick 1)")
    parser.add_argument("--duration", type=float, help="seconds per wrk run (default 10, quick 2)")
    parser.add_argument("--drip-gap-ms", type=float, help="c: pause between two events of one stream (default 10)")
    parser.add_argument("--streams", type=int, help="concurrent slow streams (default 10000, quick 1000)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument("--only-streams", action="store_true",
                        help="only (re)run the concurrent-streams test, updating OUT/overhead.json")
    parser.add_argument("--envoy", action="store_true",
                        help="only the Endpoint Picker rows: Envoy alone (round robin), Envoy + the gateway as "
                        "picker, the HTTP front, side by side (bench/envoy_overhead.py; overhead-envoy.md)")
    parser.add_argument("--report-only", action="store_true",
                        help="only re-render overhead.md, plots and profile.md from OUT/overhead.json")


def _sections(value: str) -> tuple[str, ...]:
    chosen = tuple(s.strip() for s in value.split(",") if s.strip())
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown}; choose from {','.join(SECTIONS)}")
    return tuple(s for s in SECTIONS if s in chosen)


@dataclass(slots=True)
class Results:
    meta: dict[str, Any]
    points: list[dict[str, Any]] = field(default_factory=list)  # one row per wrk run: a, b, c and sweep
    openloop: list[dict[str, Any]] = field(default_factory=list)
    ttft: dict[str, Any] = field(default_factory=dict)
    streams10k: dict[str, Any] = field(default_factory=dict)
    profiles: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _progress() -> Iterator[Progress]:
    with Progress(TextColumn("{task.description:<52}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn()) as progress:
        yield progress


def _plan(args: argparse.Namespace) -> Plan:
    plan = QUICK if args.quick else FULL
    return replace(plan, rounds=args.rounds or plan.rounds, duration_s=args.duration or plan.duration_s,
                   sections=args.only or plan.sections, streams_n=args.streams or plan.streams_n,
                   drip_gap_ms=args.drip_gap_ms or plan.drip_gap_ms)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.envoy:
        from bench import envoy_overhead

        return envoy_overhead.run(args, argv)
    if args.report_only:
        report.write(orjson.loads((args.out / "overhead.json").read_bytes()), args.out)
        return 0
    plan = _plan(args)
    if args.only_streams:
        return _only_streams(plan, args.out, argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "tmp" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    tmp.mkdir(parents=True)
    nofile = procs.raise_nofile(65536)
    res = Results(meta={**run_info.machine_info(argv), "stream_request_bytes": chat_bodies.size(STREAM_BODY),
                        "plan": asdict(plan), "nofile": nofile, "peers": {}})
    if "streams" in plan.sections and 2 * plan.streams_n + 32 > nofile:
        res.notes.append(
            f"open-file limit is {nofile} (hard limit; raising it needs CAP_SYS_RESOURCE, which this machine "
            f"lacks): one gateway worker holding {plan.streams_n} streams needs {plan.streams_n} client + "
            f"{plan.streams_n} upstream sockets plus its own ~20 descriptors, so the last few streams may fail "
            "with EMFILE here; run with `--streams N` below the limit to see the gateway's own behaviour")
    chosen = [p for p, on in ((peers.VLLM_ROUTER, args.peers), (peers.SGLANG_ROUTER, args.peers),
                              (peers.SMG, args.peers), (peers.LITELLM, args.litellm)) if on]
    started: list[Any] = []
    busy0, t0 = procs.machine_busy_seconds(), time.monotonic()
    try:
        baseline = None
        if args.baseline:
            print(f"building the baseline {args.baseline} (mypyc when the current tree is compiled: minutes)")
            baseline, res.meta["baseline"] = procs.baseline_sources(args.baseline, tmp)
        _run(plan, res, out, tmp, started, _install(chosen, res), baseline)
    finally:
        for p in reversed(started):
            p.stop()
    res.meta["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    res.meta["machine_cpu_util"] = (procs.machine_busy_seconds() - busy0) / (time.monotonic() - t0)
    res.meta["wall_s"] = time.monotonic() - t0
    (out / "overhead.json").write_bytes(orjson.dumps(asdict(res), option=orjson.OPT_INDENT_2))
    report.write(asdict(res), out)
    print(f"results: {out / 'overhead.md'}")
    return 0


def _install(chosen: Sequence[peers.Peer], res: Results) -> list[peers.Peer]:
    ok = []
    for peer in chosen:
        why = peers.install(peer)
        if why is None:
            ok.append(peer)
            res.meta["peers"][peer.name] = {"requirement": peer.requirement, "version": peers.version(peer)}
        else:
            res.notes.append(f"peer {peer.name} left out: {why}")
    return ok


@dataclass(slots=True)
class Section:
    """One family of targets in front of one upstream, and the request the measurements send them."""

    key: str  # json | sse | drip
    upstream: Target
    targets: list[Target]
    body: Path
    stream: bool
    probes: dict[str, measure.Probe] = field(default_factory=dict)

    def target(self, name: str) -> Target | None:
        return next((t for t in self.targets if t.name == name), None)


def _families(plan: Plan) -> dict[str, bool]:
    s = set(plan.sections)
    return {"json": bool(s & {"a", "sweep", "openloop", "profile"}), "sse": bool(s & {"b", "ttft", "profile"}),
            "drip": bool(s & {"c", "profile"})}


def _run(plan: Plan, res: Results, out: Path, tmp: Path, started: list[Any], chosen: list[peers.Peer],
         baseline: Path | None) -> None:
    files = {"json": tmp / "chat.json", "sse": tmp / "stream.json", "drip": tmp / "drip.json",
             "drip_long": tmp / "drip-long.json"}
    long = chat_bodies.stream(max_tokens=plan.drip_long_tokens)
    for key, body in (("json", CHAT_BODY), ("sse", STREAM_BODY), ("drip", DRIP_BODY), ("drip_long", long)):
        files[key].write_bytes(orjson.dumps(body))
    script = wrk.write_script(tmp)
    need = _families(plan)
    sink = PyServer("otlp-sink", "bench.otlp_sink", [], tmp)  # where the traced gateways export
    started.append(sink)
    opts = targets.Options(pure_sources=procs.pure_sources(tmp), peers=chosen, baseline=baseline, otlp=sink.url)
    if opts.pure_sources is None:
        res.notes.append("the gateway is pure Python here (no `make native`): no separate pure build measured")
    fams: dict[str, Section] = {}
    if need["json"] or need["sse"]:
        nginx = Nginx(tmp)
        started.append(nginx)
        for key, url in (("json", nginx.json_url), ("sse", nginx.sse_url)):
            if need[key]:
                up = Target("direct", url, nginx.proc.pid)
                fams[key] = Section(key, up, targets.start(key, url, up.pgid, tmp, opts, started,
                                                           files[key].read_bytes(), res.notes),
                                    files[key], stream=key == "sse")
    if need["drip"]:
        drip = PyServer("drip", "bench.drip_sse", ["--tokens", str(plan.drip_tokens),
                                                   "--gap-ms", str(plan.drip_gap_ms)], tmp)
        started.append(drip)
        up = Target("direct", drip.url, drip.pid)
        fams["drip"] = Section("drip", up, targets.start("drip", drip.url, drip.pid, tmp, opts, started,
                                                         files["drip"].read_bytes(), res.notes),
                               files["drip"], stream=True)
        if "c" in plan.sections:  # the same targets asked for a longer answer: c's marginal cost per chunk
            fams["drip_long"] = Section("drip_long", up, fams["drip"].targets, files["drip_long"], stream=True)
    for fam in fams.values():
        for t in fam.targets:
            fam.probes[t.name] = measure.check(t, fam.body.read_bytes(), stream=fam.stream)
            if t.command:
                res.meta["peers"][t.name].setdefault("commands", {})[fam.key] = t.command
    res.meta["events"] = {key: {t: p.events for t, p in fam.probes.items()} for key, fam in fams.items()}
    res.meta["response_bytes"] = {key: {t: p.wire_bytes for t, p in fam.probes.items()} for key, fam in fams.items()}

    measured = [(k, fams[f]) for k, f in (("a", "json"), ("b", "sse"), ("c", "drip"), ("c_long", "drip_long"))
                if k.removesuffix("_long") in plan.sections]
    n_steps = (sum(len(f.targets) for f in fams.values()) + plan.rounds * sum(len(f.targets) for _, f in measured)
               + (plan.rounds * len(plan.sweep_concurrency) * len(fams["json"].targets)
                  if "sweep" in plan.sections else 0)
               + ("ttft" in plan.sections)
               + (plan.rounds * len(plan.openloop_fractions) * len(overhead_parts.openloop_targets(fams))
                  if "openloop" in plan.sections else 0)
               + 4 * ("profile" in plan.sections) + ("streams" in plan.sections))
    with _progress() as progress:
        task = progress.add_task("warm-up", total=n_steps)

        def step(description: str) -> None:
            progress.update(task, description=description)

        def done() -> None:
            progress.advance(task)

        for fam in fams.values():
            for t in fam.targets:
                step(f"warm-up {fam.key} {t.name}")
                wrk.run(t.url + "/v1/chat/completions", fam.body, script, connections=plan.concurrency,
                        duration_s=plan.warmup_s)
                done()

        # a, b and c: every round measures every target of each, in turn (`targets.measuring_order`).
        for rnd in range(plan.rounds):
            for key, fam in measured:
                for t in targets.measuring_order(fam.targets, rnd):
                    step(f"{key} c={plan.concurrency} {t.name} (round {rnd + 1}/{plan.rounds})")
                    res.points.append(measure.point(key, t, fam.upstream, body=fam.body, script=script,
                                                    conns=plan.concurrency, duration_s=plan.duration_s, rnd=rnd,
                                                    probe_=fam.probes[t.name], stream=fam.stream))
                    done()
        if "sweep" in plan.sections:
            fam = fams["json"]
            for rnd in range(plan.rounds):
                for c in plan.sweep_concurrency:
                    for t in fam.targets:
                        step(f"sweep c={c} {t.name} (round {rnd + 1}/{plan.rounds})")
                        res.points.append(measure.point("sweep", t, fam.upstream, body=fam.body, script=script,
                                                        conns=c, duration_s=plan.duration_s, rnd=rnd,
                                                        probe_=fam.probes[t.name], stream=False))
                        done()
        if "ttft" in plan.sections:
            fam = fams["sse"]
            step(f"TTFT x{plan.ttft_n}, sequential, interleaved")
            res.ttft = overhead_parts.loadgen("ttft", "--body", str(fam.body), "-n", str(plan.ttft_n),
                                *[a for t in fam.targets for a in ("--url", t.url + "/v1/chat/completions")],
                                timeout_s=900)
            res.ttft["names"] = {t.url + "/v1/chat/completions": t.name for t in fam.targets}
            done()
        if "openloop" in plan.sections:
            overhead_parts.openloop(plan, res, fams, step, done)
        if "profile" in plan.sections:
            overhead_parts.profile(plan, res, out, tmp, fams, script, step, done)
        if "streams" in plan.sections:
            step(f"{plan.streams_n} concurrent slow streams")
            res.streams10k = overhead_parts.streams(plan, tmp, files["drip"], started)
            done()


def _only_streams(plan: Plan, out: Path, argv: list[str]) -> int:
    res: dict[str, Any] = orjson.loads((out / "overhead.json").read_bytes())
    tmp = out / "tmp" / dt.datetime.now().strftime("%Y%m%d-%H%M%S-streams")
    tmp.mkdir(parents=True)
    nofile = procs.raise_nofile(65536)
    stream_file = tmp / "stream.json"
    stream_file.write_bytes(orjson.dumps(DRIP_BODY))
    started: list[Any] = []
    try:
        result = overhead_parts.streams(plan, tmp, stream_file, started)
    finally:
        for p in reversed(started):
            p.stop()
    result["command"] = " ".join(["./.venv/bin/python", "-m", "bench", *argv])
    result["ramp_s"] = plan.streams_ramp_s
    res["streams10k"] = result
    res["meta"]["nofile"] = nofile
    (out / "overhead.json").write_bytes(orjson.dumps(res, option=orjson.OPT_INDENT_2))
    report.write(res, out)
    print(orjson.dumps(result).decode())
    return 0
