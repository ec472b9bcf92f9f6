"""bench/report.py: ratios and differences are taken within a round, then the median; the Targets
table says met / missed against issue 13's goals, and warns when a run cannot answer them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import report
from bench.report_stats import Points


def row(section: str, target: str, rnd: int, cpu_us: float, *, events: int = 0, reads: float | None = None,
        c: int = 64) -> dict[str, Any]:
    return {"section": section, "target": target, "round": rnd, "c": c, "requests": 1000, "responses": 1000.0,
            "errors": 0, "rps": 1000.0, "p50_ms": 1.0, "p90_ms": 1.5, "p99_ms": 2.0, "wall_s": 1.0,
            "cpu_s": cpu_us * 1e-3, "cpu_ticks_s": cpu_us * 1e-3, "cpu_us_per_req": cpu_us,
            "req_per_cpu_s": 1e6 / cpu_us, "events_per_response": events,
            "cpu_us_per_chunk": cpu_us / events if events else None, "reads_per_response": reads,
            "cpu_util": 0.5, "upstream_cpu_util": 0.1, "wrk_cpu_util": 0.1, "other_cpu_util": 0.2}


def result(points: list[dict[str, Any]], rounds: int = 3) -> dict[str, Any]:
    plan = {"rounds": rounds, "duration_s": 10, "sections": ["a", "b", "c"], "concurrency": 64,
            "sweep_concurrency": [1, 8, 256], "drip_tokens": 64, "drip_gap_ms": 10, "ttft_n": 500,
            "streams_ramp_s": 10}
    meta = {"date": "d", "commit": "abc", "command": "cmd", "nproc": "2", "cpu": "cpu", "loadavg_before": ["1"],
            "python": "3.11", "aiohttp": "3", "nginx": "nginx", "wrk": "wrk", "plan": plan, "nofile": 1024,
            "peers": {"vllm-router": {"version": "0.1.17", "requirement": "vllm-router==0.1.17"}}}
    return {"meta": meta, "points": points, "openloop": [], "ttft": {}, "streams10k": {}, "profiles": {},
            "notes": []}


def test_ratios_pair_rounds_before_taking_the_median() -> None:
    # Round by round the gateway costs 0.9x, 1.2x and 1.0x vllm-router's: the quoted ratio is 1.0x,
    # although the medians of each target alone (100 / 90) would say 1.11x.
    gw = [100, 120, 80]
    vr = [111.1, 100, 80]
    p = Points([row("a", "gateway", i, g) for i, g in enumerate(gw)]
                      + [row("a", "vllm-router", i, v) for i, v in enumerate(vr)])
    ratio = p.ratio("a", "cpu_us_per_req", "gateway", "vllm-router")
    assert ratio is not None
    assert abs(ratio - 1.0) < 1e-9
    assert p.med("a", "gateway", "cpu_us_per_req") == 100


def test_per_chunk_beyond_lean_is_the_per_round_difference_over_the_events() -> None:
    p = Points([row("c", "gateway", i, g, events=67) for i, g in enumerate([2000, 2134, 1000])]
                      + [row("c", "lean", i, v, events=67) for i, v in enumerate([1933, 2000, 933])])
    assert p.per_chunk_beyond("c", "gateway", "lean") == 1.0  # (67, 134, 67) / 67


def test_targets_table_says_met_and_missed_for_both_builds() -> None:
    points = []
    for i in range(3):
        points += [row("a", "gateway", i, 100), row("a", "pure", i, 150), row("a", "vllm-router", i, 110),
                   row("b", "gateway", i, 120), row("b", "pure", i, 180), row("b", "vllm-router", i, 100),
                   row("c", "gateway", i, 67 * 31, events=67, reads=68), row("c", "pure", i, 67 * 33, events=67,
                                                                             reads=68),
                   row("c", "lean", i, 67 * 30, events=67, reads=68),
                   row("c", "vllm-router", i, 67 * 32, events=67),
                   # 192 more events cost the gateway 1.25 µs each beyond lean's, the pure build 2 µs
                   row("c_long", "gateway", i, 67 * 31 + 192 * 11.25, events=259),
                   row("c_long", "pure", i, 67 * 33 + 192 * 12, events=259),
                   row("c_long", "lean", i, 67 * 30 + 192 * 10, events=259),
                   row("c_long", "vllm-router", i, 67 * 31 + 192 * 12, events=259)]
    lines = report.targets_table(result(points), Points(points))
    verdicts = [line.rsplit("|", 2)[-2].strip() for line in lines[2:]]
    # a: gateway 0.91x met, pure 1.36x missed; b: 1.2x and 1.8x missed; c against vllm-router's CPU per
    # response: 0.97x met, 1.03x missed, and the long answer 0.97x and 1.03x; c per chunk beyond lean:
    # 1.25 µs met, 2 µs missed, and the amortised figures (1 and 3 µs per chunk) shown without a verdict
    assert verdicts == ["**met**", "**missed**", "**missed**", "**missed**", "**met**", "**missed**", "**met**",
                        "**missed**", "**met**", "", "**missed**", ""]
    assert "pure-Python build" in lines[3]
    assert "c: streaming CPU per request, one event per write" in lines[6]
    assert "| 1.25 µs |" in lines[10]
    assert "| 1.00 µs |" in lines[11]


def test_the_marginal_cost_per_chunk_cancels_the_per_request_work() -> None:
    # The gateway spends 500 µs more per request than lean whatever the length, and 0.5 µs per chunk.
    points = []
    for i, noise in enumerate([1.0, 1.1, 0.9]):
        points += [row("c", "gateway", i, (500 + 67 * 10.5) * noise, events=67),
                   row("c_long", "gateway", i, (500 + 259 * 10.5) * noise, events=259),
                   row("c", "lean", i, 67 * 10 * noise, events=67),
                   row("c_long", "lean", i, 259 * 10 * noise, events=259)]
    p = Points(points)
    beyond = p.marginal_beyond("gateway", "lean")
    assert beyond is not None
    assert abs(beyond - 0.5) < 1e-9
    assert {k: round(v, 9) for k, v in p.slopes("lean").items()} == {0: 10.0, 1: 11.0, 2: 9.0}
    amortised = p.per_chunk_beyond("c", "gateway", "lean")
    assert amortised is not None
    assert amortised > 7


def test_without_vllm_router_there_is_no_verdict_and_the_report_says_why() -> None:
    points = [row("a", "gateway", i, 100) for i in range(3)]
    lines = report.targets_table(result(points), Points(points))
    assert lines[2].endswith("| – | – |")
    assert "`--peers`" in lines[2]


def test_report_warns_about_too_few_rounds_and_coalesced_events(tmp_path: Path) -> None:
    points = [row("a", "gateway", 0, 100), row("c", "gateway", 0, 2000, events=67, reads=30.0),
              row("c", "lean", 0, 1900, events=67, reads=68.0)]
    res = result(points, rounds=1)
    report.write(res, tmp_path)
    md = (tmp_path / "overhead.md").read_text()
    assert "**Provisional:** 1 round(s)" in md
    assert "c, round 1, gateway: 30.0 reads per response for 67 events" in md
    assert "lean: 68.0 reads" not in md
    assert (tmp_path / "targets.png").stat().st_size > 0


def test_the_previous_commit_is_a_target_of_its_own() -> None:
    points = []
    for i in range(3):
        points += [row("a", "gateway", i, 100), row("a", "baseline", i, 98),
                   row("b", "gateway", i, 120), row("b", "baseline", i, 100)]
    res = result(points)
    res["meta"]["baseline"] = "a1e4282"
    lines = [line for line in report.targets_table(res, Points(points)) if "a1e4282" in line]
    assert len(lines) == 2
    assert lines[0].endswith("| **met** |")
    assert "1.02×" in lines[0]
    assert lines[1].endswith("| **missed** |")
    assert "1.20×" in lines[1]


def test_the_tracing_table_puts_off_one_percent_and_all_side_by_side() -> None:
    points = []
    for i, (off, one, full) in enumerate([(100, 104, 150), (110, 110, 176), (90, 99, 117)]):
        points += [row("a", "gateway", i, off), row("a", "trace-1%", i, one), row("a", "trace-100%", i, full)]
    table = report.tracing_table(Points(points))
    assert table[2] == "| a: non-streaming (c=64) | 100.0 | 104.0 (1.04×) | 150.0 (1.50×) |"  # medians of rounds
    assert "## Tracing" in report.markdown(result(points))
    assert report.tracing_table(Points([row("a", "gateway", 0, 100)])) == []  # a run without them: no table
