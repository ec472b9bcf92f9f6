"""bench/scale_report.py: the Targets table says met / missed against issue 26's scale goals, with
vllm-router beside the gateway where the measurement applies, and the load beside the load-bound rows."""

from __future__ import annotations

import math
from typing import Any

from bench import scale_report


def _idle(target: str, kib: float) -> dict[str, Any]:
    before = 80 << 20
    levels = [{"streams": n, "before_bytes": before, "rss_bytes": before + int(n * kib * 1024), "fds": 2 * n + 17,
               "tcp_mem_kib": 0.0, "ready": {"first": n}, "released_s": 0.5 if target == "gateway" else None,
               "fds_left_after_reset": 0 if target == "gateway" else 2 * n} for n in (2500, 5000, 9974)]
    return {"target": target, "command": "cmd", "nofile": 20_000, "fds_before": 17, "streams_max": 9974,
            "levels": levels, "slope_kib": kib, "average_kib": kib}


def _active(target: str, lag_p99_ms: float | None) -> dict[str, Any]:
    return {"target": target, "rate": 5.0, "streams": 2000, "cpu_cores": 0.4, "others_cores": 1.25,
            "events_per_s": 9990.0, "expected_events_per_s": 10_000.0, "nominal_gap_ms": 200.0,
            "lag_p50_ms": 1.0 if lag_p99_ms is not None else None, "lag_p99_ms": lag_p99_ms,
            "lag_within_10ms": 0.995 if lag_p99_ms is not None else None,
            "lag_samples": 160.0 if lag_p99_ms is not None else None,
            "result": {"open": 2000, "gap_p50_ms": 200.5, "gap_p99_ms": 212.0}}


def _wrk(rps: list[float]) -> dict[str, Any]:
    return {"rps": rps, "median_rps": sorted(rps)[len(rps) // 2], "others_cores": [0.3] * len(rps), "errors": 0}


def result() -> dict[str, Any]:
    meta = {"command": "./.venv/bin/python -m bench scale", "date": "d", "commit": "abc", "source_digest": "s",
            "build": "native", "nproc": "2", "cpu": "cpu", "kernel": "k", "python": "3.11",
            "loadavg_before": ["1", "1", "1"], "loadavg_after": ["2", "2", "2"], "machine_cores_busy": 1.5,
            "wall_s": 600.0, "nofile": 20_000, "peers": {"vllm-router": "0.1.17"},
            "plan": {"idle_ramp_per_s": 500, "active_streams": 2000, "active_ramp_s": 10, "active_settle_s": 5,
                     "active_window_s": 40, "workers_runs": 3, "workers_duration_s": 8}}
    return {"meta": meta, "idle": [_idle("gateway", 13.2), _idle("vllm-router", 90.0)],
            "active": [_active("gateway", 12.5), _active("vllm-router", None)],
            "workers": {"rows": [{"workers": 1, **_wrk([1000, 1100, 900])}, {"workers": 2, **_wrk([1900, 1950, 2000])}],
                        "ratio": 1.95, "vllm-router": _wrk([2500, 2600, 2400])},
            "notes": []}


def test_targets_say_met_and_missed_with_vllm_router_beside_the_gateway() -> None:
    lines = scale_report.summary(result())
    idle, lag, workers = lines[2:]
    assert "| 13.2 | 90.0 | < 16 KiB | **met** |" in idle
    assert "| 12.5 ms | no such metric (tokio) | < 10 ms | **missed** |" in lag
    assert "others 1.25 cores" in lag  # the load goes with the load-bound figure
    assert "| 1.95x | 2,500 req/s (one process) | >= 1.8x | **met** |" in workers


def test_the_report_names_the_command_and_how_socket_memory_is_excluded() -> None:
    text = scale_report.markdown(result())
    assert "`./.venv/bin/python -m bench scale`" in text
    assert "slab memory that no process's RSS counts" in text
    assert "re-measured on a quiet machine" in text
    assert "| gateway | 9,974 of 9,974 |" in text
    assert "| within 0.5 s |" in text
    assert "**no**: 19,948 descriptors still open after 10 s |" in text
    assert "| gateway --workers 2 | 1,950 |" in text


def test_a_run_of_one_section_renders_without_the_others() -> None:
    res = result() | {"active": [], "workers": {}}
    lines = scale_report.summary(res)
    assert len(lines) == 3
    assert scale_report.active_table(res)[2:] == []
    assert scale_report.workers_table(res) == []
    assert math.isfinite(res["idle"][0]["slope_kib"])


def test_the_workers_table_computes_the_ceiling_of_the_shared_cores() -> None:
    """One worker at 60 µs a request, nginx 15 and wrk 25: 2 cores give at most 2e6 / 100 = 20,000
    req/s, set against one worker's measured req/s and what two workers reached."""
    res = result()
    one, two = res["workers"]["rows"]
    one["cpu_us_per_request"] = {"target": 60.0, "upstream": 15.0, "wrk": 25.0}
    two["cpu_us_per_request"] = {"target": 62.0, "upstream": 15.0, "wrk": 25.0}
    res["workers"]["cores"] = 2
    text = "\n".join(scale_report.workers_table(res))
    assert "| 60.0 / 15.0 / 25.0 |" in text
    assert "at most 20,000 req/s, 20.00x one worker" in text  # one worker's median here is 1,000 req/s
    assert "reached 10% of it" in text  # 1,950 of 20,000
