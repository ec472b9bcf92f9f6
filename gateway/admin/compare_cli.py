"""`gateway compare`: the live comparison of a running gateway, in the terminal or as JSON.

It reads the same `/admin/compare` document the dashboard polls, so the figures are the same:
`--scope replica` (the default) is the gateway at `--url`, all its workers; `--scope fleet` merges
every replica that shares its store (`state.redis_url`). The tables fit an 80-column terminal: each
group type gets two narrow tables (performance, then cost) rather than one wide one, headers are
abbreviated (a legend says what they mean), and row names are never cut. The cost table leads with
the cost at sustained throughput, then the utilisation, then the cost at the observed load, which on
an idle or lightly loaded fleet is dominated by idle hours.
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

LEGEND = ("TTFT/ITL: time to first token / inter-token latency, p50 and p99 in ms at the gateway; "
          "$/1M sust: cost per 1M output tokens at the best sustained throughput; util: observed output "
          "tokens/s as a share of that; $/1M now: cost at the observed load (idle time is paid for)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the gateway's base URL")
    parser.add_argument("--window", type=int, default=60, choices=WINDOWS_S, help="window in seconds")
    parser.add_argument("--watch", type=float, default=0.0, metavar="S", help="refresh every S seconds")
    parser.add_argument("--json", action="store_true", help="print the /admin/compare document as JSON")
    parser.add_argument("--scope", default="replica", choices=("replica", "fleet"),
                        help="this gateway (all its workers), or every replica sharing its store")


def _num(x: float | int | None, fmt: str = "{:,.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _ms(x: float | int | None) -> str:
    return "–" if x is None else f"{x * 1000:,.0f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.0f}%"


def _usd(x: float | None) -> str:
    return "–" if x is None else f"${x:,.2f}"


def _table(title: str, columns: Sequence[str]) -> Table:
    t = Table(title=title, title_justify="left", pad_edge=False, padding=(0, 1))
    for i, col in enumerate(columns):
        if i == 0:  # the row names: never cut, never wrapped
            t.add_column(col, justify="left", no_wrap=True, overflow="ignore", min_width=4)
        else:
            t.add_column(col, justify="right", no_wrap=True)
    return t


def performance_table(title: str, rows: Sequence[dict[str, Any]]) -> Table:
    t = _table(title, ("name", "req/s", "tok/s", "TTFT ms", "ITL ms", "err", "cache", "SLA", "n"))
    for r in rows:
        ttft, itl = r["ttft_s"], r["itl_s"]
        t.add_row(
            r["name"], _num(r["requests_per_s"], "{:,.2f}"), _num(r["output_tokens_per_s"], "{:,.0f}"),
            f"{_ms(ttft['p50'])}/{_ms(ttft['p99'])}", f"{_ms(itl['p50'])}/{_ms(itl['p99'])}",
            _pct(r["error_rate"]), _pct(r["cached_token_share"]), _pct(r["sla"]["attainment"]),
            f"{r['requests']:,}",
        )
    return t


def cost_table(title: str, rows: Sequence[dict[str, Any]]) -> Table:
    t = _table(title, ("name", "$/h", "$/1M sust", "sust tok/s", "util", "$/1M now"))
    for r in rows:
        cost = r["cost"]
        t.add_row(
            r["name"], _usd(cost["usd_per_hour"]), _usd(cost["usd_per_million_output_tokens_at_best"]),
            _num(cost["best_output_tokens_per_s"], "{:,.0f}"), _pct(cost.get("utilisation")),
            _usd(cost["usd_per_million_output_tokens"]),
        )
    return t


def render(doc: dict[str, Any], console: Console) -> None:
    scope = doc.get("scope", "replica")
    where = (f"fleet of {len(doc.get('replicas', []))} replicas" if scope == "fleet"
             else f"this gateway, {doc.get('workers', 1)} worker(s)")
    console.print(f"[bold]Live comparison[/] over the last {doc['window_s']} s "
                  f"(measured span {doc['total']['span_s']} s; {where})")
    for title, key in (("Runtimes", "runtimes"), ("Backends", "backends"), ("A/B arms", "arms")):
        if doc[key]:
            console.print(performance_table(title, doc[key]))
            console.print(cost_table(f"{title}: cost", doc[key]))
    for ab in doc["ab"]:
        srm = ab["srm"]
        flag = " [red]SRM![/]" if srm["flagged"] else ""
        console.print(f"[bold]{ab['route']}[/]: {ab['verdict']}  (SRM p={srm['p_value']:.3g}{flag})")
    console.print(f"[dim]{LEGEND}[/]")
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
        if args.json:
            sys.stdout.write(json_codec.dumps(doc).decode() + "\n")
            sys.stdout.flush()
        else:
            if args.watch > 0:
                console.clear()
            render(doc, console)
        if args.watch <= 0:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
