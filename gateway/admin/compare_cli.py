"""`gateway compare`: the live comparison of a running gateway, as tables in the terminal.

It reads the same `/admin/compare` document the dashboard polls, so the figures are the same:
`--scope replica` (the default) is the gateway at `--url`, all its workers; `--scope fleet` merges
every replica that shares its store (`state.redis_url`).
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from .. import json_codec
from ..stats import WINDOWS_S


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the gateway's base URL")
    parser.add_argument("--window", type=int, default=60, choices=WINDOWS_S, help="window in seconds")
    parser.add_argument("--watch", type=float, default=0.0, metavar="S", help="refresh every S seconds")
    parser.add_argument("--scope", default="replica", choices=("replica", "fleet"),
                        help="this gateway (all its workers), or every replica sharing its store")


def _num(x: float | int | None, fmt: str = "{:,.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _ms(x: float | int | None) -> str:
    return "–" if x is None else f"{x * 1000:,.1f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.1f}%"


def group_table(title: str, rows: Sequence[dict[str, Any]]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("name", "req/s", "out tok/s", "in tok/s", "TTFT p50/p95/p99 ms", "ITL p50/p95/p99 ms",
                "errors", "cached", "SLA", "$/1M out", "$/1M at best", "n"):
        t.add_column(col, justify="left" if col == "name" else "right")
    for r in rows:
        ttft, itl, cost = r["ttft_s"], r["itl_s"], r["cost"]
        t.add_row(
            r["name"], _num(r["requests_per_s"], "{:,.2f}"), _num(r["output_tokens_per_s"]),
            _num(r["prompt_tokens_per_s"]),
            "/".join(_ms(ttft[k]) for k in ("p50", "p95", "p99")),
            "/".join(_ms(itl[k]) for k in ("p50", "p95", "p99")),
            _pct(r["error_rate"]), _pct(r["cached_token_share"]), _pct(r["sla"]["attainment"]),
            _num(cost["usd_per_million_output_tokens"], "${:,.2f}"),
            _num(cost["usd_per_million_output_tokens_at_best"], "${:,.2f}"),
            f"{r['requests']:,}",
        )
    return t


def render(doc: dict[str, Any], console: Console) -> None:
    scope = doc.get("scope", "replica")
    where = (f"fleet of {len(doc.get('replicas', []))} replicas" if scope == "fleet"
             else f"this gateway, {doc.get('workers', 1)} worker(s)")
    console.print(f"[bold]Live comparison[/] over the last {doc['window_s']} s "
                  f"(measured span {doc['total']['span_s']} s; {where})")
    console.print(group_table("Runtimes", doc["runtimes"]))
    console.print(group_table("Backends", doc["backends"]))
    if doc["arms"]:
        console.print(group_table("A/B arms", doc["arms"]))
    for ab in doc["ab"]:
        srm = ab["srm"]
        flag = " [red]SRM![/]" if srm["flagged"] else ""
        console.print(f"[bold]{ab['route']}[/]: {ab['verdict']}  (SRM p={srm['p_value']:.3g}{flag})")
    console.print("[dim]Assumptions: " + "; ".join(doc["assumptions"]) + "[/]")


def fetch(url: str, window: int, scope: str = "replica") -> dict[str, Any]:
    """GET /admin/compare with the standard library (the CLI needs no HTTP client dependency)."""
    query = urllib.parse.urlencode({"window": window, "scope": scope})
    with urllib.request.urlopen(f"{url.rstrip('/')}/admin/compare?{query}", timeout=10) as resp:
        doc: dict[str, Any] = json_codec.loads(resp.read())
    return doc


def main(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console()
    while True:
        try:
            doc = fetch(args.url, args.window, args.scope)
        except (urllib.error.URLError, OSError) as exc:
            print(f"cannot read {args.url}/admin/compare: {exc}", file=sys.stderr)
            return 1
        if args.watch > 0:
            console.clear()
        render(doc, console)
        if args.watch <= 0:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
