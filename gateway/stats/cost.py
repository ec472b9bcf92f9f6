"""Cost per million output tokens, from configured prices and measured throughput.

    usd per 1M output tokens = usd_per_hour / (3600 × output tokens/s) × 1e6

A group's price is the sum of its backends' `usd_per_hour`; if any of them has no price the group's
cost is unknown (None) rather than silently cheaper. No throughput means no finite cost (None).
"""

from __future__ import annotations

from collections.abc import Iterable

from .peak import PEAK_HORIZON_S, PEAK_LAG_S, PEAK_QUANTILE, PEAK_SPAN_S

ASSUMPTIONS = (
    "usd_per_hour from config (backends.*.usd_per_hour); a group's price is the sum over its backends",
    "output tokens/s measured at the gateway over the window (usage from the runtime, else counted from chunks): "
    "each finished request's completion tokens spread evenly from its first to its last token, so streams "
    "still running are not counted yet",
    "cost at observed load = usd_per_hour / (3600 × output tokens/s) × 1e6: idle time is paid for",
    f"cost at best throughput = the same formula at the best output tokens/s: the "
    f"{round(PEAK_QUANTILE * 100)}th percentile of the busy {PEAK_SPAN_S}-s spans of the last {PEAK_HORIZON_S // 60} "
    f"min, each scored {PEAK_LAG_S} s after it ended (tokens of streams still running then are left out)",
    "utilisation = observed output tokens/s / best output tokens/s; cost at observed load = cost at best / "
    "utilisation",
    "a backend shared by several groups (routes, arms) is charged in full to each",
    "cost per 1M prompt tokens (what embedding models are paid for) = usd_per_hour / (3600 × prompt tokens/s) × 1e6 "
    "over the window",
    "a group with any backend lacking usd_per_hour, or with no output tokens, has cost null",
)


def group_price(prices: Iterable[float | None]) -> float | None:
    """Summed usd_per_hour, or None when any backend's price is unknown (or there are none)."""
    total = 0.0
    seen = False
    for p in prices:
        if p is None:
            return None
        total += p
        seen = True
    return total if seen else None


def usd_per_million(usd_per_hour: float | None, tokens_per_s: float | None) -> float | None:
    if usd_per_hour is None or not tokens_per_s:
        return None
    return usd_per_hour / (3600.0 * tokens_per_s) * 1e6
