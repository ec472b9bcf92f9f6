"""The last five minutes as a time series, per group, for the dashboard's charts.

Each point summarises one completed, aligned 10-s step (not a sliding window), read straight from the
1-s buckets, so a chart drawn on page load already shows history and every viewer sees the same
points. Steps before a group existed are null, not zero.
"""

from __future__ import annotations

import math
from typing import Any

from .book import Group
from .cost import group_price, usd_per_million
from .quantiles import gap_summary, summary
from .views import BookView

STEP_S = 10
POINTS = 30


def group_history(book: BookView, g: Group, now: float) -> dict[str, list[float | None]]:
    series = g.series
    last_end = math.floor(now) // STEP_S * STEP_S
    price = group_price(book.prices.get(n) for n in g.backends)
    out: dict[str, list[float | None]] = {
        "output_tokens_per_s": [], "ttft_p50_s": [], "itl_p50_s": [], "usd_per_million_output_tokens": [],
    }
    for k in range(POINTS - 1, -1, -1):
        end = last_end - k * STEP_S
        span = end - max(end - STEP_S, series.start_s)
        if span <= 0:
            for v in out.values():
                v.append(None)
            continue
        bs = list(series.fine.range(end - STEP_S, end))
        tps = math.fsum(b.output_tokens for b in bs) / span  # generated in the step (see `window`)
        out["output_tokens_per_s"].append(tps)
        out["ttft_p50_s"].append(summary((b.ttft for b in bs), (0.5,))["p50"])
        out["itl_p50_s"].append(gap_summary((b.itl for b in bs), (0.5,))["p50"])
        out["usd_per_million_output_tokens"].append(usd_per_million(price, tps))
    return out


def history(book: BookView, now: float) -> dict[str, Any]:
    last_end = math.floor(now) // STEP_S * STEP_S
    return {
        "step_s": STEP_S,
        "end_offsets_s": [last_end - k * STEP_S - now for k in range(POINTS - 1, -1, -1)],
        "runtimes": {g.name: group_history(book, g, now) for g in book.runtimes.values()},
        "backends": {g.name: group_history(book, g, now) for g in book.backends.values()},
    }
