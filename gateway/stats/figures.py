"""One group's figures over one window: rates, percentiles, error rate, cache share, SLA, cost.

Counts (`requests`, `errors`, `prompt_tokens`, `output_tokens`, `cached_tokens`, the SLA tallies) and
the latency percentiles cover the requests that *finished* in the window. `output_tokens_per_s` (and
the cost at observed load built on it) is throughput: the completion tokens of finished requests
that were generated *during* the window (each request's tokens spread over its generation time,
`window`), divided by the window's span. `best_output_tokens_per_s` is the decaying p90 of busy
10-s spans over the last hour (`peak`), whatever the window.
"""

from __future__ import annotations

import math
from typing import Any

from .book import Group
from .cost import group_price, usd_per_million
from .quantiles import gap_summary, summary
from .views import BookView
from .window import View


def _rate(count: int, span_s: int) -> float | None:
    return count / span_s if span_s > 0 else None


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def figures(book: BookView, g: Group, now: float, window_s: int) -> dict[str, Any]:
    g.series.advance(now)
    v: View = g.series.view(now, window_s)
    bs = v.buckets
    requests = sum(b.requests for b in bs)
    errors = sum(b.errors for b in bs)
    prompt = sum(b.prompt_tokens for b in bs)
    completion = sum(b.completion_tokens for b in bs)
    generated = math.fsum(b.output_tokens for b in bs)
    cached = sum(b.cached_tokens for b in bs)
    met = sum(b.sla_met for b in bs)
    missed = sum(b.sla_missed for b in bs)
    out_tps = generated / v.span_s if v.span_s > 0 else None
    price = group_price(book.prices.get(n) for n in g.backends)
    peak = g.series.peak_output_tps
    return {
        "span_s": v.span_s,
        "requests": requests,
        "errors": errors,
        "requests_per_s": _rate(requests, v.span_s),
        "error_rate": _ratio(errors, requests),
        "prompt_tokens": prompt,
        "output_tokens": completion,
        "cached_tokens": cached,
        "prompt_tokens_per_s": _rate(prompt, v.span_s),
        "output_tokens_per_s": out_tps,
        "cached_token_share": _ratio(cached, prompt),
        "ttft_s": summary(b.ttft for b in bs),
        "itl_s": gap_summary(b.itl for b in bs),
        "tpot_s": summary(b.tpot for b in bs),
        "e2e_s": summary(b.e2e for b in bs),
        "sla": {"met": met, "missed": missed, "attainment": _ratio(met, met + missed)},
        "cost": {
            "usd_per_hour": price,
            "usd_per_million_output_tokens": usd_per_million(price, out_tps),
            "best_output_tokens_per_s": peak,
            "usd_per_million_output_tokens_at_best": usd_per_million(price, peak),
            # how much of its sustained throughput the group used in the window: the at-load cost is the
            # at-best cost divided by this (an idle fleet's hours are paid for all the same)
            "utilisation": out_tps / peak if out_tps is not None and peak else None,
            # what embedding models are paid for: their input (at the observed load)
            "usd_per_million_prompt_tokens": usd_per_million(price, _rate(prompt, v.span_s)),
        },
    }
