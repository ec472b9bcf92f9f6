"""The dashboard in a real headless Chromium: charts render, the page keeps updating, and it looks right.

Set GATEWAY_DASHBOARD_PNG=docs/dashboard.png to keep the screenshot (taken once the history holds
GATEWAY_DASHBOARD_WAIT_S more seconds of load, default 90, so the charts show some history)."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.integration.harness import GatewayProcess, eventually, wait_for

from .conftest import CHROMIUM

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium(tmp: Path, *args: str) -> str:
    assert CHROMIUM is not None
    profile = tmp / f"profile-{time.monotonic_ns()}"
    out = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--window-size=1400,1000", *args],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return out.stdout


def dump(tmp: Path, url: str) -> str:
    return chromium(tmp, "--virtual-time-budget=7000", "--dump-dom", url)


def attr(dom: str, name: str) -> int:
    m = re.search(rf'<body[^>]*\b{name}="(\d+)"', dom)
    assert m, f"no {name} on <body>"
    return int(m.group(1))


def compare(gw: GatewayProcess) -> dict[str, Any]:
    doc: dict[str, Any] = gw.get("/admin/compare", params={"window": 60}).json()
    return doc


def history_steps(doc: dict[str, Any]) -> int:
    """Completed 10-s history steps that every runtime and backend has (0 until the first one ends)."""
    series = [*doc["history"]["runtimes"].values(), *doc["history"]["backends"].values()]
    return min(sum(v is not None for v in s["output_tokens_per_s"]) for s in series)


def test_dashboard_renders_charts_and_updates_live(loaded_gateway: GatewayProcess, tmp_path: Path) -> None:
    wait_for(lambda: compare(loaded_gateway), lambda doc: history_steps(doc) >= 1, timeout=30,
             what="a completed 10-s step of history")
    url = loaded_gateway.url + "/dashboard"
    first = dump(tmp_path, url)
    assert attr(first, "data-updates") >= 2  # it polled more than once within the virtual-time budget
    for scope in ("runtime", "backend"):
        for chart in ("output_tokens_per_s", "ttft_p50_s", "itl_p50_s", "usd_per_million_output_tokens"):
            assert f'data-chart="{scope}-{chart}"' in first
    paths = re.findall(r'<path d="(M[^"]+)"[^>]*data-series="([^"]+)"', first)
    assert {name for _, name in paths} >= {"vllm", "sglang", "trtllm", "triton", "vllm-a", "sglang-a"}
    assert all(re.fullmatch(r"([ML][\d.]+ [\d.-]+ ?)+", d) for d, _ in paths)
    assert 'data-route="ab"' in first  # the A/B verdict card
    assert "not enough data yet" in first or "no significant difference" in first or "lower (95% CI" in first

    seen = attr(first, "data-total-requests")
    eventually(lambda: compare(loaded_gateway)["total"]["requests"] != seen, timeout=30)  # the figure moved on
    second = dump(tmp_path, url)
    assert attr(second, "data-total-requests") != seen

    keep = os.environ.get("GATEWAY_DASHBOARD_PNG")
    if keep:  # more history for the docs picture
        more = math.ceil(float(os.environ.get("GATEWAY_DASHBOARD_WAIT_S", "90")) / 10)
        steps = min(history_steps(compare(loaded_gateway)) + more, 30)  # the history holds 30 steps
        eventually(lambda: history_steps(compare(loaded_gateway)) >= steps, timeout=10 * more + 30)
    shot = tmp_path / "dashboard.png"
    chromium(tmp_path, "--virtual-time-budget=5000", "--hide-scrollbars", f"--screenshot={shot}", url)
    assert shot.stat().st_size > 20_000
    if keep:
        shutil.copyfile(shot, keep)


def test_a_wide_servers_ranks_have_rows_of_their_own(loaded_gateway: GatewayProcess, tmp_path: Path) -> None:
    wait_for(lambda: compare(loaded_gateway), lambda doc: {r["rank"] for r in doc["ranks"]} == {0, 1}, timeout=30,
             what="requests served on both of vllm-a's ranks")
    dom = dump(tmp_path, loaded_gateway.url + "/dashboard")
    section = re.search(r'<section id="ranks-section"([^>]*)>(.*?)</section>', dom, re.S)
    assert section is not None
    assert "hidden" not in section.group(1)
    rows = re.findall(r"<tr><td>([^<]+)</td><td>(\d+)</td><td>([^<]+)</td>", section.group(2))
    assert sorted(rows) == [("vllm-a", "0", "vllm"), ("vllm-a", "1", "vllm")]


def test_the_scope_toggle_switches_to_the_fleet_view(loaded_gateway: GatewayProcess, tmp_path: Path) -> None:
    url = loaded_gateway.url + "/dashboard"
    mine = dump(tmp_path, url)
    assert re.search(r'<body[^>]*\bdata-scope="replica"', mine)
    assert re.search(r'<select id="scope">', mine)
    fleet = dump(tmp_path, url + "?scope=fleet")  # (as choosing "fleet" in the toggle does)
    assert re.search(r'<body[^>]*\bdata-scope="fleet"', fleet)
    assert "fleet of 1 replicas" in fleet  # no store configured: the fleet is this gateway
    assert attr(fleet, "data-updates") >= 1


def test_dashboard_is_self_contained(loaded_gateway: GatewayProcess) -> None:
    page = loaded_gateway.get("/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    srcs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert srcs
    assert all(s.startswith("/dashboard/static/") for s in srcs)
    for s in srcs:
        assert loaded_gateway.get(s).status_code == 200
    assert loaded_gateway.get("/dashboard/static/missing.js").status_code == 404
