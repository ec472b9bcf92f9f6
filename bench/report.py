"""Turn the raw results of `bench overhead` into bench/results/overhead.md, profile.md and PNG plots.

Every figure is a median over repetitions; ratios are computed within each repetition (targets were
measured side by side) and then the median ratio is quoted.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TARGETS = ("direct", "gateway", "pure", "naive", "lean")
ANALYSIS = "profile-analysis.md"  # hand-written diagnosis, kept across runs and appended to profile.md


def _med(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "–" if v is None else format(v, fmt)


def _group(rows: list[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    out: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def _ratio(rows: list[dict[str, Any]], key: str, num: str, den: str, **match: Any) -> float | None:
    """Median over repetitions of row[num][key] / row[den][key], pairing rows of the same repetition."""
    by_rep = _group([r for r in rows if all(r.get(k) == v for k, v in match.items())], "rep")
    ratios = []
    for group in by_rep.values():
        a = next((r[key] for r in group if r["target"] == num), None)
        b = next((r[key] for r in group if r["target"] == den), None)
        if a is not None and b:
            ratios.append(a / b)
    return _med(ratios)


def _diff(rows: list[dict[str, Any]], key: str, a: str, b: str, **match: Any) -> float | None:
    by_rep = _group([r for r in rows if all(r.get(k) == v for k, v in match.items())], "rep")
    diffs = []
    for group in by_rep.values():
        x = next((r[key] for r in group if r["target"] == a), None)
        y = next((r[key] for r in group if r["target"] == b), None)
        if x is not None and y is not None:
            diffs.append(x - y)
    return _med(diffs)


def summary(res: dict[str, Any]) -> dict[str, Any]:
    closed = res["closed"]
    cs = sorted({r["c"] for r in closed})
    table = {}
    for (target, c), rows in _group(closed, "target", "c").items():
        table[(target, c)] = {k: _med(r.get(k) for r in rows) for k in
                              ("rps", "p50_ms", "p99_ms", "cpu_us_per_req", "req_per_cpu_s", "cpu_util",
                               "wrk_cpu_util", "nginx_cpu_util", "other_cpu_util")}
        table[(target, c)]["errors"] = sum(r["errors"] for r in rows)
        table[(target, c)]["runs"] = len(rows)
    per_core = {c: _ratio(closed, "req_per_cpu_s", "gateway", "naive", c=c) for c in cs}
    per_core_pure = {c: _ratio(closed, "req_per_cpu_s", "pure", "naive", c=c) for c in cs}
    native_gain = {c: _ratio(closed, "cpu_us_per_req", "pure", "gateway", c=c) for c in cs}
    logic = {c: _diff(closed, "cpu_us_per_req", "gateway", "lean", c=c) for c in cs}
    direct_over_gw = {c: _ratio(closed, "rps", "direct", "gateway", c=c) for c in cs}
    added = {c: (_diff(closed, "p50_ms", "gateway", "direct", c=c),
                 _diff(closed, "p99_ms", "gateway", "direct", c=c),
                 _diff(closed, "p50_ms", "naive", "direct", c=c)) for c in cs}
    stream = {t: {k: _med(r.get(k) for r in rows) for k in ("rps", "cpu_us_per_req", "cpu_us_per_chunk", "cpu_util",
                                                       "wrk_cpu_util", "p50_ms", "p99_ms")}
              | {"errors": sum(r["errors"] for r in rows)}
              for (t,), rows in _group(res["stream"], "target").items()}
    ttft = {}
    names = res["ttft"].get("names", {})
    for url, stats in res["ttft"].get("targets", {}).items():
        ttft[names.get(url, url)] = stats
    return {"cs": cs, "table": table, "per_core": per_core, "per_core_pure": per_core_pure,
            "native_gain": native_gain, "logic": logic, "direct_over_gw": direct_over_gw,
            "added": added, "stream": stream, "ttft": ttft}


def _other(r: dict[str, Any]) -> str:
    v = r.get("other_cpu_util")
    return "–" if v is None else f"{100 * v:.0f}%"


def _targets_table(res: dict[str, Any], s: dict[str, Any]) -> list[str]:
    t, cs = s["table"], s["cs"]
    hi = 256 if 256 in cs else max(cs)
    mid = 64 if 64 in cs else hi
    gw_cpu = t.get(("gateway", mid), {}).get("cpu_us_per_req")
    ratio = s["per_core"].get(mid)
    errs = t.get(("gateway", hi), {}).get("errors")
    chunk = s["stream"].get("gateway", {}).get("cpu_us_per_chunk")
    tt = s["ttft"]
    added_ttft = (tt["gateway"]["p50_ms"] - tt["direct"]["p50_ms"]) if "gateway" in tt and "direct" in tt else None
    st = res["streams10k"]
    st_errors = sum(st.get("errors", {}).values()) if st else None
    st_ok = bool(st) and st_errors == 0 and st.get("ok") == st.get("n")

    def verdict(ok: bool | None) -> str:
        return "–" if ok is None else ("**met**" if ok else "**missed**")

    rows = [
        (f"non-streaming gateway CPU per request, as built by `make install` (c={mid})", "≤ 120 µs",
         f"{_f(gw_cpu)} µs",
         verdict(None if gw_cpu is None else gw_cpu <= 120)),
        (f"throughput per core, gateway / naive proxy (c={mid})", "≥ 1.8×", f"{_f(ratio, '.2f')}×",
         verdict(None if ratio is None else ratio >= 1.8)),
        (f"errors at c={hi} (gateway)", "0", str(errs), verdict(None if errs is None else errs == 0)),
    ]
    pure_cpu = t.get(("pure", mid), {}).get("cpu_us_per_req")
    if pure_cpu is not None:  # the same two targets for the build without `make native`, for comparison
        pure_ratio = s["per_core_pure"].get(mid)
        rows += [
            (f"the same CPU per request, pure-Python build (c={mid})", "≤ 120 µs", f"{_f(pure_cpu)} µs",
             verdict(pure_cpu <= 120)),
            (f"the same throughput per core, pure-Python build / naive (c={mid})", "≥ 1.8×",
             f"{_f(pure_ratio, '.2f')}×", verdict(None if pure_ratio is None else pure_ratio >= 1.8)),
        ]
    rows += [
        ("streaming gateway CPU per relayed chunk", "≤ 10 µs", f"{_f(chunk)} µs",
         verdict(None if chunk is None else chunk <= 10)),
        ("added TTFT p50 at low load (gateway − direct)", "< 0.3 ms", f"{_f(added_ttft, '.3f')} ms",
         verdict(None if added_ttft is None else added_ttft < 0.3)),
        (f"{st.get('n', '?')} concurrent streams, one worker", "no errors",
         f"{st.get('ok', '?')} ok, errors {st.get('errors', {})}, peak RSS {_f(st.get('rss_peak_mb'))} MiB"
         if st else "–", verdict(st_ok if st else None)),
    ]
    out = ["| target | goal | measured | |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return out


def markdown(res: dict[str, Any], s: dict[str, Any]) -> str:
    m = res["meta"]
    t, cs = s["table"], s["cs"]
    plan = m["plan"]
    lines = [
        "# Gateway overhead benchmark", "",
        "Generated by `bench/overhead.py`; do not edit by hand (the diagnosis lives in profile.md).", "",
        "| | |", "|---|---|",
        f"| date | {m['date']} |",
        f"| commit | `{m['commit']}`, sha256 of gateway/ + backends/ sources `{m.get('source_digest', '?')}` |",
        f"| command | `{m['command']}` |",
        f"| machine | {m['nproc']} × {m['cpu']} (shared, noisy), "
        f"load average before: {' '.join(m['loadavg_before'])}, after: {' '.join(m.get('loadavg_after', ['?']))} |",
        f"| software | Python {m['python']}, aiohttp {m['aiohttp']}, {m['nginx']}, {m['wrk']} |",
        f"| plan | {plan['runs']} run(s) × {plan['duration_s']:g} s per point, targets interleaved in every run; "
        "figures are medians over runs, ratios are per-run ratios' medians |",
        f"| gateway build | {m.get('build', '?')} |", "",
        "Targets: **direct** = nginx (1 worker) serving canned vLLM 0.32.0 bodies on loopback; **gateway** = "
        "`python -m gateway serve` (one process, one `vllm` backend pointing at nginx, `health.interval_s: 5`, "
        "route model `moe`), as `make install` builds it; **pure** = the same gateway from a copy of its sources "
        "without the compiled modules (present only when the gateway under test is compiled); "
        "**naive** = `bench/naive_proxy.py`, a bare aiohttp + uvloop reverse proxy; "
        "**lean** = `bench/lean_proxy.py`, the gateway's own HTTP layers (native front + upstream client) with "
        "no parsing, routing or accounting, so gateway − lean is what the gateway's logic costs. "
        "CPU is utime+stime of the target process from `/proc/<pid>/stat` (nginx: master + worker) over the run.",
        "", "## Against the targets", "", *_targets_table(res, s), "",
        "## Non-streaming, closed loop (wrk, 1 thread)", "",
        "| c | target | req/s | p50 ms | p99 ms | errors | CPU µs/req | req per CPU-s | target CPU | wrk CPU "
        "| others' CPU |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cs:
        for name in TARGETS:
            r = t.get((name, c))
            if r:
                lines.append(f"| {c} | {name} | {_f(r['rps'], '.0f')} | {_f(r['p50_ms'], '.2f')} | "
                             f"{_f(r['p99_ms'], '.2f')} | {r['errors']} | {_f(r['cpu_us_per_req'])} | "
                             f"{_f(r['req_per_cpu_s'], '.0f')} | {_f(100 * (r['cpu_util'] or 0), '.0f')}% | "
                             f"{_f(100 * (r['wrk_cpu_util'] or 0), '.0f')}% | {_other(r)} |")
    lines += ["", "| c | gateway/naive throughput per core | direct/gateway req/s | added p50 ms (gateway − direct) | "
              "added p99 ms | naive − direct p50 ms | gateway logic µs/req (gateway − lean) "
              "| CPU per request, pure / gateway |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cs:
        a50, a99, n50 = s["added"][c]
        lines.append(f"| {c} | {_f(s['per_core'][c], '.2f')}× | {_f(s['direct_over_gw'][c], '.1f')}× | "
                     f"{_f(a50, '.3f')} | {_f(a99, '.3f')} | {_f(n50, '.3f')} | {_f(s['logic'].get(c))} | "
                     f"{_f(s['native_gain'].get(c), '.2f')}× |")
    lines += ["", "Is wrk the bottleneck? Compare wrk's own CPU with the target's (above) and the direct/gateway "
              "throughput ratio: direct-to-nginx throughput is the ceiling of the load generator plus upstream "
              "on this machine. CPU columns are in % of one core: the target process (nginx for direct), wrk itself, "
              "and everything else the shared machine ran meanwhile (from /proc/stat, minus ours).", ""]
    if res["openloop"]:
        lines += ["## Non-streaming, open loop (fixed timetable, latency from the scheduled time)", "",
                  "| rate req/s | target | ok / sent | errors | p50 ms | p90 ms | p99 ms | p99.9 ms | CPU µs/req | "
                  "generator lag max ms |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for (rate, name), rows in sorted(_group(res["openloop"], "rate", "target").items(),
                                         key=lambda kv: (kv[0][0], TARGETS.index(kv[0][1]))):
            lines.append(
                f"| {rate:g} | {name} | {sum(r['ok'] for r in rows)} / {sum(r['sent'] for r in rows)} | "
                f"{sum(sum(r['errors'].values()) for r in rows)} | {_f(_med(r['p50_ms'] for r in rows), '.2f')} | "
                f"{_f(_med(r['p90_ms'] for r in rows), '.2f')} | {_f(_med(r['p99_ms'] for r in rows), '.2f')} | "
                f"{_f(_med(r['p999_ms'] for r in rows), '.2f')} | {_f(_med(r['cpu_us_per_req'] for r in rows))} | "
                f"{_f(_med(r['generator_lag_max_ms'] for r in rows), '.1f')} |")
        lines += ["", "The open-loop generator is Python (`bench/loadgen.py openloop`, its own process); rates are "
                  "fractions of the gateway's closed-loop c=64 throughput. A generator lag well above 1 ms means "
                  "the generator itself fell behind.", ""]
    lines += ["## Streaming", "",
              f"wrk -c{plan['stream_concurrency']} POSTs `stream: true` with `include_usage`; nginx answers the "
              "canned vLLM stream (role chunk + 64 token chunks + usage chunk + [DONE] = 67 events, 14.8 kB, "
              "delivered in one burst). The gateway relays all 67 events with accounting on (usage parsed, model "
              "rewritten, TTFT and inter-token gaps observed).", "",
              "| target | streams/s | p50 ms | p99 ms | errors | CPU µs/stream | CPU µs per relayed chunk "
              "| target CPU |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in TARGETS:
        r = s["stream"].get(name)
        if r:
            lines.append(f"| {name} | {_f(r['rps'], '.0f')} | {_f(r['p50_ms'], '.2f')} | {_f(r['p99_ms'], '.2f')} | "
                         f"{r['errors']} | {_f(r['cpu_us_per_req'])} | {_f(r['cpu_us_per_chunk'], '.2f')} | "
                         f"{_f(100 * (r['cpu_util'] or 0), '.0f')}% |")
    gw_s, gw_n = s["stream"].get("gateway", {}), t.get(("gateway", 64), {})
    if gw_s.get("cpu_us_per_req") and gw_n.get("cpu_us_per_req"):
        marginal = (gw_s["cpu_us_per_req"] - gw_n["cpu_us_per_req"]) / 67
        lines += ["", f"Marginal gateway CPU per chunk (streamed request − non-streaming request at c=64, / 67): "
                      f"**{marginal:.2f} µs**. Note nginx sends the whole stream in one burst, so the gateway "
                      "reads many events per `read()`; a real engine sends one event per read, which costs a "
                      "read, a relay call and a write per event (see the 10k-streams run for that shape)."]
    if s["ttft"]:
        lines += ["", f"### Time to first token (sequential, {plan['ttft_n']} per target, interleaved)", "",
                  "| target | p50 ms | p90 ms | p99 ms | added p50 ms vs direct |", "|---|---:|---:|---:|---:|"]
        d = s["ttft"].get("direct", {}).get("p50_ms")
        for name in TARGETS:
            r = s["ttft"].get(name)
            if r:
                lines.append(f"| {name} | {_f(r['p50_ms'], '.3f')} | {_f(r['p90_ms'], '.3f')} | "
                             f"{_f(r['p99_ms'], '.3f')} | {_f(None if d is None else r['p50_ms'] - d, '.3f')} |")
        if res["ttft"].get("errors"):
            lines.append(f"\nerrors: {res['ttft']['errors']}")
    st = res["streams10k"]
    if st:
        lines += ["", f"## {st.get('n')} concurrent open streams through one gateway worker", "",
                  f"Upstream: `bench/slow_sse.py` (aiohttp, own process), one event per second, "
                  f"{st.get('events_per_stream')} events, then usage and [DONE]; client: `bench/loadgen.py streams` "
                  f"opening them over {st.get('ramp_s', plan['streams_ramp_s']):g} s, each allowed "
                  f"{st.get('events_per_stream', 30) + 30} s. Open-file limit: {m['nofile']}."
                  + (f" Run separately: `{st['command']}`." if st.get("command") else ""), "",
                  "| streams | completed with [DONE] | max open at once | errors | events received | "
                  "gateway RSS before / peak / after MiB | RSS per stream KiB | gateway CPU s | wall s |",
                  "|---:|---:|---:|---|---:|---|---:|---:|---:|",
                  f"| {st.get('n')} | {st.get('ok')} | {st.get('max_open')} | {st.get('errors') or 'none'} | "
                  f"{st.get('events')} | {_f(st.get('rss_before_mb'))} / {_f(st.get('rss_peak_mb'))} / "
                  f"{_f(st.get('rss_after_mb'))} | {_f(st.get('kib_per_stream'))} | {_f(st.get('gateway_cpu_s'))} | "
                  f"{_f(st.get('wall_s'))} |"]
    if res["peers"]:
        lines += ["", "## Peers (same wrk load, non-streaming)", "",
                  "| c | target | req/s | p50 ms | p99 ms | errors | CPU µs/req |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for (name, c), rows in sorted(_group(res["peers"], "target", "c").items()):
            lines.append(f"| {c} | {name} | {_f(_med(r['rps'] for r in rows), '.0f')} | "
                         f"{_f(_med(r['p50_ms'] for r in rows), '.2f')} | "
                         f"{_f(_med(r['p99_ms'] for r in rows), '.2f')} | "
                         f"{sum(r['errors'] for r in rows)} | {_f(_med(r['cpu_us_per_req'] for r in rows))} |")
    if res["notes"]:
        lines += ["", "## Notes", "", *[f"- {n}" for n in res["notes"]]]
    lines += ["", "Plots: `throughput-vs-concurrency.png`, `p99-vs-concurrency.png`. Profile: `profile.md`, "
              "`profile-overhead.svg`. Raw numbers: `overhead.json`.", ""]
    return "\n".join(lines)


def plots(s: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs, t = s["cs"], s["table"]
    for key, fname, ylabel, log in (("rps", "throughput-vs-concurrency.png", "requests/s (median, log scale)", True),
                                    ("p99_ms", "p99-vs-concurrency.png", "p99 latency, ms (median)", True)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, style in zip(TARGETS, ("o-", "s-", "s--", "^-", "d-"), strict=True):
            xs = [c for c in cs if (name, c) in t]
            ax.plot(xs, [t[(name, c)][key] for c in xs], style, label=name)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent connections (wrk)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"non-streaming chat completions: {ylabel.split(',')[0].split(' (')[0]}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)


def write(res: dict[str, Any], out: Path) -> None:
    s = summary(res)
    (out / "overhead.md").write_text(markdown(res, s))
    plots(s, out)
    if res["profiles"]:
        m = res["meta"]
        parts = ["# Gateway profile under load (py-spy)", "",
                 f"{m['date']}, commit `{m['commit']}`, `{m['command']}`. Flame graph of the non-streaming run: "
                 "`profile-overhead.svg`. Sampled at 200 Hz with `py-spy record --format raw`; percentages are "
                 "of the samples in which the gateway's thread was on-CPU.", ""]
        analysis = out / ANALYSIS
        if analysis.exists():
            parts += [analysis.read_text(), ""]
        parts += ["## Measured top frames", "", *res["profiles"].values()]
        (out / "profile.md").write_text("\n".join(parts))
