"""`bench scale`'s report: bench/results/scale.md (markdown, from scale.json alone) and scale.png.

`markdown` is pure (tests/bench/test_scale_report.py); `write` also draws the plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import workers

TARGET_KIB = 16.0
TARGET_LAG_MS = 10.0
TARGET_RATIO = 1.8


def _f(value: float | None, fmt: str = "{:.1f}", none: str = "n/a") -> str:
    return none if value is None else fmt.format(value)


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


def _by(rows: list[dict[str, Any]], target: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["target"] == target]


def summary(res: dict[str, Any]) -> list[str]:
    """The three targets, side by side with vllm-router where it applies."""
    lines = ["| target | gateway | vllm-router | goal | verdict |", "|---|---:|---:|---|---|"]
    idle = {r["target"]: r for r in res.get("idle", [])}
    gw = idle.get("gateway")
    if gw is not None:
        vr = idle.get("vllm-router")
        kib = gw.get("slope_kib")
        lines.append(f"| idle: KiB of RSS per open stream (slope over {len(gw['levels'])} levels, up to "
                     f"{gw['streams_max']:,} streams) | {_f(kib)} | {_f(vr.get('slope_kib') if vr else None)} | "
                     f"< {TARGET_KIB:g} KiB | {_verdict(kib < TARGET_KIB if kib is not None else None)} |")
    for row in _by(res.get("active", []), "gateway"):
        vr_row = next((r for r in _by(res["active"], "vllm-router") if r["rate"] == row["rate"]), None)
        p99 = row.get("lag_p99_ms")
        answered = row.get("metrics_answered", True)
        shown = f"{_f(p99)} ms" if answered else "/metrics did not answer in 30 s"
        lines.append(f"| active: event-loop lag p99 at {row['streams']:,} streams x {row['rate']:g} events/s "
                     f"(others {row['others_cores']:.2f} cores) | {shown} | no such metric"
                     f"{'' if vr_row is None else ' (tokio)'} | < {TARGET_LAG_MS:g} ms | "
                     f"{_verdict(p99 < TARGET_LAG_MS if p99 is not None else None if answered else False)} |")
    wk = res.get("workers") or {}
    ratio = wk.get("ratio")
    if wk.get("rows"):
        others = [o for r in wk["rows"] for o in r["others_cores"]]
        vr_rps = (wk.get("vllm-router") or {}).get("median_rps")
        lines.append(f"| workers: `--workers 2` / `--workers 1` non-streaming req/s (others up to "
                     f"{max(others, default=0):.2f} cores) | {_f(ratio, '{:.2f}x')} | "
                     f"{_f(vr_rps, '{:,.0f} req/s (one process)')} | >= {TARGET_RATIO:g}x | "
                     f"{_verdict(ratio >= TARGET_RATIO if ratio is not None else None)} |")
    return lines


def idle_table(res: dict[str, Any]) -> list[str]:
    lines = ["| target | streams open | RSS MiB | RSS before MiB | (RSS - before) / streams KiB | descriptors | "
             "kernel TCP buffers KiB (machine) | sockets released after the clients reset |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in res.get("idle", []):
        for lv in r["levels"]:
            first, before = lv["ready"]["first"], lv["before_bytes"]
            released = lv.get("released_s")
            gone = (f"within {released:.1f} s" if released is not None
                    else f"**no**: {lv.get('fds_left_after_reset', 0):,} descriptors still open after 10 s")
            lines.append(f"| {r['target']} | {first:,} of {lv['streams']:,} | {lv['rss_bytes'] / 2**20:.1f} | "
                         f"{before / 2**20:.1f} | {(lv['rss_bytes'] - before) / 1024 / max(first, 1):.2f} | "
                         f"{lv['fds']:,} | {lv['tcp_mem_kib']:,.0f} | {gone} |")
    return lines


def active_table(res: dict[str, Any]) -> list[str]:
    lines = ["| target | events/s per stream | streams | events/s delivered (expected) | loop lag p50 ms | "
             "loop lag p99 ms | lag samples <= 10 ms | client read gap p50 / p99 ms (nominal) | target cores | "
             "others' cores |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res.get("active", []):
        within = r.get("lag_within_10ms")
        lines.append(
            f"| {r['target']} | {r['rate']:g} | {r['result']['open']:,} | {_f(r['events_per_s'], '{:,.0f}')} "
            f"({r['expected_events_per_s']:,.0f}) | {_f(r.get('lag_p50_ms'), '{:.2f}')} | "
            f"{_f(r.get('lag_p99_ms'), '{:.2f}')} | "
            f"{_f(within * 100 if within is not None else None, '{:.1f}%')} "
            f"({_f(r.get('lag_samples'), '{:.0f}', '-')}) | {_f(r['result']['gap_p50_ms'])} / "
            f"{_f(r['result']['gap_p99_ms'])} ({r['nominal_gap_ms']:g}) | {r['cpu_cores']:.2f} | "
            f"{r['others_cores']:.2f} |")
    return lines


def workers_table(res: dict[str, Any]) -> list[str]:
    wk = res.get("workers") or {}
    rows = list(wk.get("rows", []))
    if not rows:
        return []
    base = rows[0]["median_rps"]
    lines = ["| target | req/s (median) | runs | vs 1 worker | CPU µs per request: target / nginx / wrk "
             "| others' cores per run |", "|---|---:|---|---:|---|---|"]
    named = [(f"gateway --workers {r['workers']}", r) for r in rows]
    if wk.get("vllm-router"):
        named.append(("vllm-router (one process, its own threads)", wk["vllm-router"]))
    for label, r in named:
        cpu = r.get("cpu_us_per_request") or {}
        per_request = " / ".join(_f(cpu.get(k), "{:.1f}") for k in ("target", "upstream", "wrk")) if cpu else "–"
        lines.append(f"| {label} | {r['median_rps']:,.0f} | {', '.join(f'{x:,.0f}' for x in r['rps'])} | "
                     f"{r['median_rps'] / base:.2f}x | {per_request} | "
                     f"{', '.join(f'{o:.2f}' for o in r['others_cores'])} |")
    cores = wk.get("cores")
    top = workers.ceiling(rows[0], cores) if cores else None
    if top is not None and len(rows) > 1:
        lines += ["", f"The ceiling of these {cores} cores: at one worker's CPU per request (the gateway's, "
                  f"nginx's and wrk's, all on the same cores), they give at most {top:,.0f} req/s, "
                  f"{top / base:.2f}x one worker; `--workers {rows[-1]['workers']}` reached "
                  f"{rows[-1]['median_rps'] / top:.0%} of it. A ratio of 1.8x needs a machine where the "
                  "load generator and the upstream do not share the gateway's cores."]
    return lines


SHARED_CORES = 0.2  # others' cores above which the load-bound figures are not quoted


def _sharing_note(res: dict[str, Any]) -> str:
    """Whether the load-bound figures came from a quiet machine (the *others' cores* columns)."""
    others = [r["others_cores"] for r in res.get("active", [])]
    others += [o for r in (res.get("workers") or {}).get("rows", []) for o in r["others_cores"]]
    if max(others, default=0.0) <= SHARED_CORES:
        return (f"The rest of the machine used at most {max(others, default=0.0):.2f} cores during the "
                "load-bound measurements (the *others' cores* columns): a quiet machine.")
    return ("The loop-lag and workers figures come from a machine shared with other work (the *others' cores* "
            "columns: CPU the rest of the machine used meanwhile, out of 2): they must be re-measured on a quiet "
            "machine before they are quoted. The idle memory figure hardly depends on load.")


def markdown(res: dict[str, Any]) -> str:
    meta = res["meta"]
    plan = meta["plan"]
    out = [
        "# Scale: idle streams, loop lag under active streams, workers scaling (issue 26, item 2)", "",
        f"- command: `{meta['command']}`",
        f"- {meta['date']}, commit `{meta['commit']}` (sources {meta['source_digest']}), {meta['build']}",
        f"- machine: {meta['nproc']} cores ({meta['cpu']}), kernel {meta['kernel']}, Python {meta['python']}; "
        f"load average before {' '.join(meta['loadavg_before'])}, after {' '.join(meta.get('loadavg_after', []))}; "
        f"the whole machine kept {meta.get('machine_cores_busy', 0):.2f} cores busy over the run "
        f"({meta.get('wall_s', 0) / 60:.1f} min)",
        f"- open-file limit {meta['nofile']:,} (the hard limit; raising it needs CAP_SYS_RESOURCE): two sockets "
        "per stream, so one process holds at most about half of it",
        f"- peers: {', '.join(f'{k} {v}' for k, v in meta['peers'].items()) or 'none'}", "",
        "## Targets", "", *summary(res), "",
        _sharing_note(res), "",
        "## idle", "",
        f"Streams opened at {plan['idle_ramp_per_s']:g}/s by `bench/hold_streams.py` (a bare asyncio client) "
        "through the target to `bench/drip_sse.py`, which sends the role event and then nothing for an hour. "
        "Each level in a fresh proxy and upstream; RSS sampled every 0.5 s until it settled (the last 4 samples "
        "within 1%). *KiB per stream* is the least-squares slope of (RSS - RSS before the level's first stream) "
        "over the levels and the origin; the per-level average is beside it. The last column: whether the proxy "
        "closed the streams' sockets (its own and the upstream's) once the clients reset theirs. "
        "How socket memory is excluded: RSS counts user-space pages only, and the kernel's socket "
        "structures and buffers (struct sock, skbs, receive and send queues) are slab memory that no process's "
        "RSS counts; the kernel's TCP buffer pages of the whole machine (`/proc/net/sockstat`, every socket of "
        "client, proxy and upstream) are in the last column. What *is* counted: the proxy's user-space objects "
        "per connection (uvloop transports and libuv handles, or hyper/tokio's for vllm-router), since they "
        "are the proxy's own memory.", "",
        *idle_table(res), "",
    ]
    for r in res.get("idle", []):
        out.append(f"- {r['target']}: {_f(r.get('slope_kib'), '{:.2f}')} KiB per stream (slope), "
                   f"{_f(r.get('average_kib'), '{:.2f}')} KiB (average at the largest level); at most "
                   f"{r['streams_max']:,} streams fit its {r['nofile']:,} descriptors ({r['fds_before']} in use "
                   "before); `" + r["command"] + "`")
    out += ["", "## active", "",
            f"{plan['active_streams']:,} streams opened over {plan['active_ramp_s']:g} s, "
            f"{plan['active_settle_s']:g} s to settle, then a {plan['active_window_s']:g} s window. The upstream "
            "(`bench/drip_sse.py`) sends each "
            "stream one event every 1/rate s from a timer of its own, so events arrive spread over time. Loop "
            "lag: deltas of the gateway's `gateway_event_loop_lag_seconds` buckets over the window (a 0.25 s "
            "timer, so 4 observations a second), quantiles interpolated within buckets as `histogram_quantile` "
            "does (bounds 1, 2.5, 5, 10, 25 ms ...). vllm-router exports no event-loop metric (tokio has no "
            "single loop to lag); for both targets the *client read gap* is the time between two reads of one "
            "stream that carried events, against the upstream's nominal gap: what a client sees of the whole "
            "path's delay.", "", *active_table(res), "",
            "## workers", "",
            f"`python -m gateway serve --workers N` against nginx serving a canned vLLM chat completion, "
            f"issue 13's 1.2 KB chat body, wrk -t1 -c64, {plan['workers_runs']} runs x "
            f"{plan['workers_duration_s']:g} s after a 2 s warm-up (bench/workers.py's measurement); nginx and "
            "wrk share the same 2 cores.", "", *workers_table(res), ""]
    if res.get("notes"):
        out += ["## Notes", "", *(f"- {n}" for n in res["notes"]), ""]
    return "\n".join(out)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    ax = axes[0]
    for r in res.get("idle", []):
        xs = [0] + [lv["ready"]["first"] for lv in r["levels"]]
        ys = [0.0] + [(lv["rss_bytes"] - lv["before_bytes"]) / 2**20 for lv in r["levels"]]
        ax.plot(xs, ys, marker="o", label=f"{r['target']} ({_f(r.get('slope_kib'))} KiB/stream)")
    ax.set(title="idle: RSS growth against open streams", xlabel="streams open", ylabel="RSS - before (MiB)")
    ax.legend(fontsize=8)
    ax = axes[1]
    for target in ("gateway", "vllm-router"):
        rows = _by(res.get("active", []), target)
        if target == "gateway" and rows:
            ax.plot([r["rate"] for r in rows], [r.get("lag_p99_ms") or 0 for r in rows], marker="o",
                    label="gateway loop lag p99")
        if rows:
            ax.plot([r["rate"] for r in rows],
                    [(r["result"]["gap_p99_ms"] or 0) - r["nominal_gap_ms"] for r in rows], marker="x",
                    linestyle="--", label=f"{target}: client gap p99 - nominal")
    ax.axhline(TARGET_LAG_MS, color="grey", linewidth=0.8)
    streams = (res.get("active") or [{}])[0].get("streams", 0)
    ax.set(title=f"active: {streams:,} streams", xlabel="events/s per stream", ylabel="ms")
    ax.legend(fontsize=8)
    ax = axes[2]
    wk = res.get("workers") or {}
    labels, values = [], []
    for r in wk.get("rows", []):
        labels.append(f"--workers {r['workers']}")
        values.append(r["median_rps"])
    if wk.get("vllm-router"):
        labels.append("vllm-router")
        values.append(wk["vllm-router"]["median_rps"])
    ax.bar(labels, values, color=["#4c72b0", "#4c72b0", "#dd8452"][: len(values)])
    ax.set(title=f"workers: non-streaming req/s (ratio {_f(wk.get('ratio'), '{:.2f}x')})", ylabel="req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(res: dict[str, Any], out: Path) -> str:
    text = markdown(res)
    (out / "scale.md").write_text(text)
    plot(res, out / "scale.png")
    return text
