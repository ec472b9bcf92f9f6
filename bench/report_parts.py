"""The report's parts other than issue 13's three targets: the earlier targets, the concurrency
sweep, the open loop, time to first token and the concurrent slow streams."""

from __future__ import annotations

from typing import Any

from bench.report_stats import Points, fmt, group, med, order, pct, times, verdict


def earlier_table(res: dict[str, Any], p: Points) -> list[str]:
    """Targets of earlier issues, still measured."""
    rows = []
    if p.of("a", "gateway") and p.of("a", "naive"):
        per_core = p.ratio("a", "req_per_cpu_s", "gateway", "naive")
        rows.append(("throughput per core, gateway / naive proxy (a, c=64)", "≥ 1.8×", times(per_core),
                     verdict(None if per_core is None else per_core >= 1.8)))
    hi = max((r["c"] for r in p.rows if r["section"] == "sweep"), default=None)
    if hi is not None:
        errs = sum(r["errors"] for r in p.of("sweep", "gateway", hi))
        rows.append((f"errors at c={hi} (gateway)", "0", str(errs), verdict(errs == 0)))
    tt = ttft(res)
    if "gateway" in tt and "direct" in tt:
        added = tt["gateway"]["p50_ms"] - tt["direct"]["p50_ms"]
        rows.append(("added TTFT p50 at low load (gateway − direct)", "< 0.3 ms", f"{added:.3f} ms",
                     verdict(added < 0.3)))
    st = res["streams10k"]
    if st:
        errors = sum(st.get("errors", {}).values())
        rows.append((f"{st.get('n', '?')} concurrent streams, one worker", "no errors",
                     f"{st.get('ok', '?')} ok, errors {st.get('errors', {})}, "
                     f"peak RSS {fmt(st.get('rss_peak_mb'))} MiB",
                     verdict(errors == 0 and st.get("ok") == st.get("n"))))
    if not rows:
        return []
    return ["| target | goal | measured | |", "|---|---|---|---|",
            *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]]


def ttft(res: dict[str, Any]) -> dict[str, Any]:
    names = res["ttft"].get("names", {})
    return {names.get(url, url): stats for url, stats in res["ttft"].get("targets", {}).items()}


def closed_rows(p: Points) -> list[dict[str, Any]]:
    """Non-streaming rows at every concurrency: the sweep plus a (c=64)."""
    return [r for r in p.rows if r["section"] in ("a", "sweep")]


def sweep(p: Points) -> list[str]:
    if not any(r["section"] == "sweep" for r in p.rows):
        return []
    rows = closed_rows(p)
    out = ["## Non-streaming at other concurrencies (wrk, 1 thread)", "",
           "c=64 is part a. Is wrk the bottleneck? Compare wrk's CPU with the target's: direct-to-nginx "
           "throughput is the ceiling of load generator plus upstream on this machine.", "",
           "| c | target | req/s | p50 ms | p99 ms | errors | CPU µs/req | target CPU | wrk CPU | others' CPU |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (c, name), same in sorted(group(rows, "c", "target").items(), key=lambda kv: (kv[0][0], order(kv[0][1]))):
        out.append(f"| {c} | {name} | {fmt(med(r['rps'] for r in same), '.0f')} | "
                   f"{fmt(med(r['p50_ms'] for r in same), '.2f')} | {fmt(med(r['p99_ms'] for r in same), '.2f')} | "
                   f"{sum(r['errors'] for r in same)} | {fmt(med(r['cpu_us_per_req'] for r in same))} | "
                   f"{pct(med(r['cpu_util'] for r in same))} | {pct(med(r['wrk_cpu_util'] for r in same))} | "
                   f"{pct(med(r['other_cpu_util'] for r in same))} |")
    return [*out, ""]


def openloop(res: dict[str, Any]) -> list[str]:
    if not res["openloop"]:
        return []
    out = ["## Non-streaming, open loop (fixed timetable, latency from the scheduled time)", "",
           "| rate req/s | target | ok / sent | errors | p50 ms | p90 ms | p99 ms | p99.9 ms | CPU µs/req | "
           "generator lag max ms |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (rate, name), rows in sorted(group(res["openloop"], "rate", "target").items(),
                                     key=lambda kv: (kv[0][0], order(kv[0][1]))):
        out.append(
            f"| {rate:g} | {name} | {sum(r['ok'] for r in rows)} / {sum(r['sent'] for r in rows)} | "
            f"{sum(sum(r['errors'].values()) for r in rows)} | {fmt(med(r['p50_ms'] for r in rows), '.2f')} | "
            f"{fmt(med(r['p90_ms'] for r in rows), '.2f')} | {fmt(med(r['p99_ms'] for r in rows), '.2f')} | "
            f"{fmt(med(r['p999_ms'] for r in rows), '.2f')} | {fmt(med(r['cpu_us_per_req'] for r in rows))} | "
            f"{fmt(med(r['generator_lag_max_ms'] for r in rows), '.1f')} |")
    return [*out, "", "The open-loop generator is Python (`bench/loadgen.py openloop`, its own process); rates are "
            "fractions of the gateway's c=64 throughput in a. A generator lag well above 1 ms means the generator "
            "itself fell behind.", ""]


def ttft_lines(res: dict[str, Any]) -> list[str]:
    tt = ttft(res)
    if not tt:
        return []
    n = res["meta"]["plan"]["ttft_n"]
    out = [f"## Time to first token (b's stream, sequential, {n} per target, interleaved)", "",
           "| target | p50 ms | p90 ms | p99 ms | added p50 ms vs direct |", "|---|---:|---:|---:|---:|"]
    d = tt.get("direct", {}).get("p50_ms")
    for name in sorted(tt, key=order):
        r = tt[name]
        out.append(f"| {name} | {fmt(r['p50_ms'], '.3f')} | {fmt(r['p90_ms'], '.3f')} | {fmt(r['p99_ms'], '.3f')} | "
                   f"{fmt(None if d is None else r['p50_ms'] - d, '.3f')} |")
    if res["ttft"].get("errors"):
        out.append(f"\nerrors: {res['ttft']['errors']}")
    return [*out, ""]


def streams(res: dict[str, Any]) -> list[str]:
    st, m = res["streams10k"], res["meta"]
    if not st:
        return []
    return [f"## {st.get('n')} concurrent open streams through one gateway worker", "",
            f"Upstream: `bench/slow_sse.py` (aiohttp, own process), one event per second, "
            f"{st.get('events_per_stream')} events, then usage and [DONE]; client: `bench/loadgen.py streams` "
            f"opening them over {st.get('ramp_s', m['plan']['streams_ramp_s']):g} s, each allowed "
            f"{st.get('events_per_stream', 30) + 30} s. Open-file limit: {m['nofile']}."
            + (f" Run separately: `{st['command']}`." if st.get("command") else ""), "",
            "| streams | completed with [DONE] | max open at once | errors | events received | "
            "gateway RSS before / peak / after MiB | RSS per stream KiB | gateway CPU s | wall s |",
            "|---:|---:|---:|---|---:|---|---:|---:|---:|",
            f"| {st.get('n')} | {st.get('ok')} | {st.get('max_open')} | {st.get('errors') or 'none'} | "
            f"{st.get('events')} | {fmt(st.get('rss_before_mb'))} / {fmt(st.get('rss_peak_mb'))} / "
            f"{fmt(st.get('rss_after_mb'))} | {fmt(st.get('kib_per_stream'))} | {fmt(st.get('gateway_cpu_s'))} | "
            f"{fmt(st.get('wall_s'))} |", ""]
