"""Turn the raw results of `bench overhead` into bench/results/overhead.md, profile.md and PNG plots.

Every figure is a median over rounds; a ratio or a difference between two targets is computed within
each round (the targets were measured one after the other in it) and the median of those is quoted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import report_parts, report_plots
from bench.report_stats import Points, fmt, med, pct, times, verdict
from bench.targets import PYTHON, TRACED

ANALYSIS = "profile-analysis.md"  # hand-written diagnosis, kept across runs and appended to profile.md
MIN_ROUNDS = 3  # issue 13: medians of >= 3 interleaved rounds
CHUNK_GOAL_US = 1.5
REGRESSION_GOAL = 1.05  # issue 12: CPU per request within 5% of the previous commit's
SECTION_TITLES = {
    "a": "a. Non-streaming",
    "b": "b. Streaming, 20 events in one write",
    "c": "c. Streaming, one event per write",
    "c_long": "c, long. Streaming, one event per write, the long answer",
}


def targets_table(res: dict[str, Any], p: Points) -> list[str]:
    """Issue 13's three targets and issue 26's (CPU per request at or below vllm-router's in both
    delivery styles), for the build `make install` makes and for the pure-Python one."""
    builds = [b for b in ("gateway", "pure") if any(p.of(s, b) for s in "abc")]
    label = {"gateway": "as `make install` builds it", "pure": "pure-Python build"}
    out = ["| target (issues 13, 26) | build | goal | measured | ratio / difference (median of rounds) | |",
           "|---|---|---|---|---|---|"]
    for section, what in (("a", "non-streaming CPU per request"),
                          ("b", "streaming CPU per request, 20 events in one write"),
                          ("c", f"streaming CPU per request, one event per write, {_events(res)} events"),
                          ("c_long", "streaming CPU per request, one event per write, the long answer")):
        vr = p.med(section, "vllm-router", "cpu_us_per_req")
        for b in builds:
            mine = p.med(section, b, "cpu_us_per_req")
            if mine is None:
                continue
            ratio = p.ratio(section, "cpu_us_per_req", b, "vllm-router")
            measured = f"{fmt(mine)} µs vs vllm-router {fmt(vr)} µs" if vr is not None else \
                f"{fmt(mine)} µs (vllm-router not run: `--peers`)"
            out.append(f"| {section}: {what} (c={_c(p, section)}) | {label[b]} | ≤ vllm-router's | {measured} | "
                       f"{times(ratio)} | {verdict(None if ratio is None else ratio <= 1.0)} |")
    for b in builds:
        if not p.of("c", b):
            continue
        if p.of("c_long", b):  # the target: what one more chunk costs, the per-request work cancelled out
            beyond = p.marginal_beyond(b, "lean")
            mine, lean = med(p.slopes(b).values()), med(p.slopes("lean").values())
            out.append(f"| c: CPU per additional relayed chunk beyond the plain relay (lean), one event per write "
                       f"| {label[b]} | ≤ {CHUNK_GOAL_US:g} µs | {fmt(mine, '.2f')} µs vs lean {fmt(lean, '.2f')} µs "
                       f"per extra chunk | {fmt(beyond, '.2f')} µs "
                       f"| {verdict(None if beyond is None else beyond <= CHUNK_GOAL_US)} |")
        beyond = p.per_chunk_beyond("c", b, "lean")
        mine, lean = p.med("c", b, "cpu_us_per_chunk"), p.med("c", "lean", "cpu_us_per_chunk")
        out.append(f"| c (amortised): CPU per response beyond lean / its events, {_events(res)} events | {label[b]} | "
                   f"– | {fmt(mine, '.2f')} µs vs lean {fmt(lean, '.2f')} µs per chunk | {fmt(beyond, '.2f')} µs | |")
    base = res["meta"].get("baseline")
    for section in ("a", "b", "c", "c_long"):  # issue 12: no regression beyond 5% against the previous commit
        if not p.of(section, "baseline") or not p.of(section, "gateway"):
            continue
        ratio = p.ratio(section, "cpu_us_per_req", "gateway", "baseline")
        out.append(f"| {section}: CPU per response against commit {base} (issue 12) | {label['gateway']} | "
                   f"≤ {REGRESSION_GOAL:.2f}x | {fmt(p.med(section, 'gateway', 'cpu_us_per_req'))} µs vs "
                   f"{fmt(p.med(section, 'baseline', 'cpu_us_per_req'))} µs | {times(ratio)} | "
                   f"{verdict(None if ratio is None else ratio <= REGRESSION_GOAL)} |")
    return out


def tracing_table(p: Points) -> list[str]:
    """CPU per request with tracing off (the gateway), sampling 1% and 100%, measured in the same rounds."""
    traced = [t for t in TRACED if any(p.of(s, t) for s in ("a", "b", "c"))]
    if not traced:
        return []
    out = ["| part | tracing off (gateway), CPU µs/request | "
           + " | ".join(f"{t.removeprefix('trace-')} sampled, µs/request (× off, median of rounds)" for t in traced)
           + " |", "|---|---:|" + "---:|" * len(traced)]
    for section, what in (("a", "a: non-streaming"), ("b", "b: streaming, 20 events in one write"),
                          ("c", "c: streaming, one event per write")):
        off = p.med(section, "gateway", "cpu_us_per_req")
        if off is None:
            continue
        cells = [f"{fmt(p.med(section, t, 'cpu_us_per_req'))} "
                 f"({times(p.ratio(section, 'cpu_us_per_req', t, 'gateway'))})" for t in traced]
        out.append(f"| {what} (c={_c(p, section)}) | {fmt(off)} | " + " | ".join(cells) + " |")
    return out


def _events(res: dict[str, Any]) -> str:
    return str(res["meta"].get("events", {}).get("drip", {}).get("direct", "?"))


def _c(p: Points, section: str) -> str:
    cs = sorted({r["c"] for r in p.rows if r["section"] == section})
    return ",".join(str(c) for c in cs) or "?"


def _rounds_of(rows: list[dict[str, Any]], key: str, spec: str) -> str:
    return " / ".join(fmt(r.get(key), spec) for r in sorted(rows, key=lambda r: r["round"]))


def section_table(res: dict[str, Any], p: Points, section: str) -> list[str]:
    stream = section in ("b", "c", "c_long")
    head = "| target | CPU µs/response | per round | "
    head += "CPU µs per chunk | reads per response | " if stream else "req per CPU-s | "
    head += "responses/s | p50 ms | p99 ms | errors | target CPU | upstream CPU | wrk CPU | others' CPU (max) |"
    out = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for name in p.targets(section):
        rows = p.of(section, name)
        cells = [name, fmt(med(r["cpu_us_per_req"] for r in rows)), _rounds_of(rows, "cpu_us_per_req", ".0f")]
        if stream:
            cells += [fmt(med(r["cpu_us_per_chunk"] for r in rows), ".2f"),
                      fmt(med(r.get("reads_per_response") for r in rows)) if name in PYTHON else "–"]
        else:
            cells += [fmt(med(r["req_per_cpu_s"] for r in rows), ".0f")]
        upstream = "(is the upstream)" if name == "direct" else pct(med(r["upstream_cpu_util"] for r in rows))
        cells += [fmt(med(r["responses"] / r["wall_s"] for r in rows), ".0f"),
                  fmt(med(r["p50_ms"] for r in rows), ".2f"), fmt(med(r["p99_ms"] for r in rows), ".2f"),
                  str(sum(r["errors"] for r in rows)), pct(med(r["cpu_util"] for r in rows)), upstream,
                  pct(med(r["wrk_cpu_util"] for r in rows)),
                  f"{pct(med(r['other_cpu_util'] for r in rows))} ({pct(max(r['other_cpu_util'] for r in rows))})"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def ratios_table(p: Points, section: str) -> list[str]:
    names = p.targets(section)
    if section == "c":
        out = ["| target | CPU per chunk beyond lean, µs (median of per-round differences) | per round |",
               "|---|---:|---|"]
        for name in names:
            if name in ("lean", "direct"):
                continue
            per = [(x["cpu_us_per_req"] - y["cpu_us_per_req"]) / x["events_per_response"]
                   for x, y in p.paired("c", name, "lean") if x.get("events_per_response")]
            out.append(f"| {name} | {fmt(p.per_chunk_beyond('c', name, 'lean'), '.2f')} | "
                       f"{' / '.join(fmt(v, '.2f') for v in per)} |")
        if any(p.of("c_long", n) for n in names):
            out += ["", "| target | CPU per additional chunk, µs (long − short stream) | beyond lean, µs | per round |",
                    "|---|---:|---:|---|"]
            for name in names:
                slopes = p.slopes(name)
                out.append(f"| {name} | {fmt(med(slopes.values()), '.2f')} | "
                           f"{'–' if name == 'lean' else fmt(p.marginal_beyond(name, 'lean'), '.2f')} | "
                           f"{' / '.join(fmt(slopes[k], '.2f') for k in sorted(slopes))} |")
        return out
    dens = [d for d in ("vllm-router", "sglang-router", "smg", "baseline", "lean", "naive") if d in names]
    out = ["| CPU per response, ratio | " + " | ".join(f"/ {d}" for d in dens) + " |",
           "|---|" + "---:|" * len(dens)]
    for name in ("gateway", *TRACED, "pure"):
        if name in names:
            out.append(f"| {name} | " + " | ".join(
                times(p.ratio(section, "cpu_us_per_req", name, d)) for d in dens) + " |")
    return out


def _section_text(res: dict[str, Any], section: str) -> str:
    m, plan = res["meta"], res["meta"]["plan"]
    ev = m.get("events", {})
    if section == "a":
        return (f"wrk -c{plan['concurrency']} POSTs the {m.get('request_bytes', '?')}-byte chat request "
                f"(system prompt {m.get('system_prompt_bytes', '?')} bytes); nginx answers the canned vLLM chat "
                "completion (`bench/upstream/chat.json`).")
    if section == "c_long":
        return (f"c's request asking for {plan.get('drip_long_tokens', '?')} tokens, to the same targets in the same "
                f"rounds ({ev.get('drip_long', {}).get('direct', '?')} events): the difference to c is what the "
                "additional chunks cost, free of the per-request work (the c target above).")
    if section == "b":
        n = ev.get("sse", {}).get("direct", "?")
        return (f"The same request with `stream: true` and `include_usage`; nginx answers the canned vLLM stream "
                f"`bench/upstream/stream.sse`: a role chunk, 18 token chunks (the 18th carries `finish_reason`), "
                f"the usage chunk, i.e. exactly 20 data events, then `data: [DONE]` ({n} events counted with "
                "[DONE]), 4.6 kB sent with its head in one write (sendfile, `tcp_nopush`). CPU µs per chunk = "
                "CPU per response / events per response, [DONE] included.")
    n = ev.get("drip", {}).get("direct", "?")
    return (f"The same streaming request against `bench/drip_sse.py`: a role chunk, {plan['drip_tokens']} token "
            f"chunks, the usage chunk and [DONE] ({n} events), each event its own write "
            f"{plan['drip_gap_ms']:g} ms after the previous one (~{1000 / plan['drip_gap_ms']:.0f} tokens/s per "
            "stream, a fast engine), so that a proxy that keeps up reads them one by one: the *reads per "
            "response* column (read(2) calls of the target, from `/proc/<pid>/io`, shown for the uvloop-based "
            f"targets) is ≈ {n} events + 1 request read when no two events were coalesced. Responses are counted "
            "as bytes received / bytes of one whole response, so the streams wrk cut off at the end of a run "
            "count for what was relayed. The per-chunk figure beyond the plain relay includes each target's "
            "per-request work spread over the response's events.")


def _checks(res: dict[str, Any], p: Points) -> list[str]:
    """What a reader should know before trusting the figures (too few rounds, coalesced events, ...)."""
    out = []
    rounds = res["meta"]["plan"]["rounds"]
    if rounds < MIN_ROUNDS:
        out.append(f"**Provisional:** {rounds} round(s); issue 13 asks for medians of ≥ {MIN_ROUNDS} interleaved "
                   "rounds.")
    for r in p.rows:
        if r["section"] == "c" and r["target"] in PYTHON and r.get("reads_per_response") is not None \
                and r["reads_per_response"] < 0.9 * r["events_per_response"]:
            out.append(f"c, round {r['round'] + 1}, {r['target']}: {r['reads_per_response']:.1f} reads per response "
                       f"for {r['events_per_response']} events: events were coalesced (the machine or the target "
                       "fell behind); raise `--drip-gap-ms`.")
        if r.get("errors"):
            out.append(f"{r['section']}, round {r['round'] + 1}, {r['target']} (c={r['c']}): {r['errors']} errors.")
        ticks, ns = r.get("cpu_ticks_s"), r.get("cpu_s")
        if ticks is not None and ns is not None and abs(ticks - ns) > max(0.05, 0.1 * ns):
            out.append(f"{r['section']}, round {r['round'] + 1}, {r['target']}: CPU from schedstat {ns:.3f} s vs "
                       f"{ticks:.3f} s from /proc/<pid>/stat (threads that exited are only in the latter).")
    return out


def _meta_table(res: dict[str, Any]) -> list[str]:
    m, plan = res["meta"], res["meta"]["plan"]
    peers = m.get("peers", {})
    peer_text = "; ".join(f"{name} {v['version']} (`{v['requirement']}`)" for name, v in peers.items()) or \
        "none (run with `--peers`)"
    machine_util = m.get("machine_cpu_util")
    return [
        "| | |", "|---|---|",
        f"| date | {m['date']} |",
        f"| commit | `{m['commit']}`, sha256 of gateway/ + backends/ + bench/ sources "
        f"`{m.get('source_digest', '?')}` |",
        f"| command | `{m['command']}` |",
        f"| machine | {m['nproc']} × {m['cpu']}, kernel {m.get('kernel', '?')} (shared with other work: see each "
        f"table's *others' CPU*); load average before: {' '.join(m['loadavg_before'])}, after: "
        f"{' '.join(m.get('loadavg_after', ['?']))}; whole machine busy {pct(machine_util)} of one core on average "
        f"over the run ({fmt(m.get('wall_s'), '.0f')} s) |",
        f"| software | Python {m['python']}, aiohttp {m['aiohttp']}, {m['nginx']}, {m['wrk']} |",
        f"| peers | {peer_text} |",
        f"| gateway build | {m.get('build', '?')}; `pure` is the same sources without the compiled modules |",
        f"| plan | parts {', '.join(plan['sections'])}; {plan['rounds']} round(s) × {plan['duration_s']:g} s per point "
        f"at c={plan['concurrency']} (sweep: c={', '.join(str(c) for c in plan['sweep_concurrency'])}), "
        "targets interleaved in every round; figures are medians over rounds, ratios and differences medians "
        "of the per-round ones |",
    ]


def markdown(res: dict[str, Any]) -> str:
    p = Points(res["points"])
    lines = [
        "# Gateway overhead benchmark", "",
        "Generated by `bench/overhead.py` (`python -m bench overhead`); do not edit by hand (the diagnosis lives "
        "in profile-analysis.md).", "", *_meta_table(res), "",
        "Targets: **direct** (the upstream itself), **gateway** (`python -m gateway serve`, one vLLM backend, "
        "`policy: round_robin`), **pure** (the same, without the compiled modules), **lean** "
        "(`bench/lean_proxy.py`: the gateway's own HTTP layers with no logic, the plain byte relay), **naive** "
        "(`bench/naive_proxy.py`, a bare aiohttp + uvloop proxy), and the peers (one worker URL, "
        "`--policy round_robin`, request logging off as for the gateway). CPU is the on-CPU time of the "
        "target's whole process group from `/proc/<pid>/task/<tid>/schedstat` over the run (for direct: the "
        "upstream's). *upstream CPU* is nginx's (or the dripping server's), *wrk CPU* the load generator's, "
        "*others' CPU* the rest of this shared machine meanwhile, all in % of one core.", "",
    ]
    if any(r["section"] in "abc" for r in p.rows):
        lines += ["## Targets", "", *targets_table(res, p), ""]
    traced = tracing_table(p)
    if traced:
        lines += ["## Tracing", "", "The gateway with `tracing` on (issue 25), exporting over OTLP/gRPC to a "
                  "collector that accepts everything (`bench/otlp_sink.py`, its CPU not counted), sampling 1% and "
                  "100% of requests (`sample_ratio`), beside the gateway without it, in the same rounds. Off is a "
                  "branch on the request path (`python -m bench instructions` counts it); 1% adds the ids every "
                  "request carries and a `traceparent` upstream; 100% adds three spans per request and their "
                  "export (the SDK encodes protobuf on the export thread, which shares the GIL).", "", *traced, ""]
    checks = _checks(res, p)
    if checks:
        lines += ["Read before quoting:", "", *[f"- {c}" for c in checks], ""]
    for section in SECTION_TITLES:
        if not p.targets(section):
            continue
        lines += [f"## {SECTION_TITLES[section]} (wrk -c{_c(p, section)})", "", _section_text(res, section), "",
                  *section_table(res, p, section), "", *ratios_table(p, section), ""]
    earlier = report_parts.earlier_table(res, p)
    if earlier:
        lines += ["## Earlier targets", "", *earlier, ""]
    lines += (report_parts.sweep(p) + report_parts.openloop(res) + report_parts.ttft_lines(res)
              + report_parts.streams(res))
    peers = res["meta"].get("peers", {})
    if peers:
        lines += ["", "## Peers", "", "Installed from PyPI into `~/.cache/igw/peers/<name>` (`bench/peers.py`), "
                  "one instance in front of each upstream (json: a and the sweep, sse: b, drip: c):", ""]
        for name, v in peers.items():
            lines.append(f"- {name} {v['version']} (`{v['requirement']}`)")
            lines += [f"  - {key}: `{cmd}`" for key, cmd in v.get("commands", {}).items()]
    if res["notes"]:
        lines += ["", "## Notes", "", *[f"- {n}" for n in res["notes"]]]
    plots = (["`targets.png` (a, b, c by target)"] if any(r["section"] in "abc" for r in p.rows) else []) + \
        ([f"`{name}`" for name in report_plots.CONCURRENCY] if any(r["section"] == "sweep" for r in p.rows) else [])
    lines += ["", (f"Plots: {', '.join(plots)}. " if plots else "")
              + ("Profile: `profile.md`, `profile-overhead.svg`. " if res["profiles"] else
                 "No profile in this run (a `profile.md` beside this file is from the run it names). ")
              + "Raw numbers: `overhead.json`.", ""]
    return "\n".join(lines)


def write(res: dict[str, Any], out: Path) -> None:
    (out / "overhead.md").write_text(markdown(res))
    p = Points(res["points"])
    # A plot this run did not make would be an earlier run's beside this report: remove it.
    if not report_plots.targets(p, out / "targets.png"):
        (out / "targets.png").unlink(missing_ok=True)
    if not report_plots.concurrency(report_parts.closed_rows(p), out):
        for name in report_plots.CONCURRENCY:
            (out / name).unlink(missing_ok=True)
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
