"""`python -m bench pd`'s report: one table row per workload and pool, auto's decisions, a plot."""

from __future__ import annotations

from pathlib import Path

from bench.pd import POOLS, WORKLOADS, Stats, percentile, report, summarise

META = {"date": "d", "commit": "c", "nproc": "2", "cpu": "x", "build": "pure", "command": "python -m bench pd",
        "requests": 4, "concurrency": 2, "speed": 2.0, "output_tokens": 64, "slo_ttft_s": 1.0, "slo_itl_s": 0.15}


def test_summary_is_in_simulated_seconds_and_tokens() -> None:
    s = summarise(Stats(ttft_s=[0.1, 0.2, 0.3, 0.6], worst_gap_s=[0.05, 0.1, 0.05, 0.01],
                        itl_s=[0.01, 0.05, 0.1, 0.05, 0.01], output_tokens=400, span_s=2.0, errors=1),
                  speed=2.0, slo_ttft=1.0, slo_itl=0.15)
    assert s["ttft_p50_s"] == 0.4  # the 2nd of 4 (nearest rank), x speed
    assert s["ttft_p99_s"] == 1.2
    assert (s["itl_p50_s"], s["itl_p99_s"]) == (0.1, 0.2)
    # met: the 1st and 3rd only (the 2nd's worst gap is 0.2 s, the 4th's TTFT 1.2 s); the error counts as missed
    assert s["slo_attainment"] == 2 / 5
    assert s["output_tokens_per_s"] == 100.0  # 400 tokens over 4 simulated seconds
    assert (s["requests"], s["errors"]) == (4, 1)
    assert percentile([], 0.5) != percentile([], 0.5)  # nan: no sample


def test_the_report_has_every_pool_on_every_workload(tmp_path: Path) -> None:
    row = {"requests": 4, "errors": 0, "ttft_p50_s": 0.5, "ttft_p99_s": 0.9, "itl_p50_s": 0.05, "itl_p99_s": 0.2,
           "output_tokens_per_s": 120.0, "slo_attainment": 0.75}
    results = {p: {w: row for w in WORKLOADS} | {"gateway_metrics": {}} for p in POOLS}
    results["auto"]["gateway_metrics"] = {"gateway_pd_decisions_total{decision=split,reason=uncached}": 4.0}
    report(results, META, tmp_path)
    text = (tmp_path / "pd.md").read_text()
    assert sum(line.startswith("| long") for line in text.splitlines()) == len(POOLS)
    assert sum(line.startswith("| short") for line in text.splitlines()) == len(POOLS)
    assert "decision=split,reason=uncached}`: 4" in text
    assert (tmp_path / "pd.png").stat().st_size > 0
    assert (tmp_path / "pd.json").exists()


def test_a_subset_of_pools_reports_only_what_ran(tmp_path: Path) -> None:
    row = {"requests": 4, "errors": 0, "ttft_p50_s": 0.5, "ttft_p99_s": 0.9, "itl_p50_s": 0.05, "itl_p99_s": 0.2,
           "output_tokens_per_s": 120.0, "slo_attainment": 0.5}
    results = {p: {w: row for w in WORKLOADS} | {"gateway_metrics": {}} for p in ("pd", "auto-both")}
    report(results, META, tmp_path)
    text = (tmp_path / "pd.md").read_text()
    assert sum(line.startswith("| long") for line in text.splitlines()) == 2
    assert "What `auto-both` decided" in text
    assert "What `auto` decided" not in text
