"""A/B statistics for split routes: bootstrap intervals, a sample-ratio-mismatch check, a verdict.

Latency is skewed and heavy-tailed, so intervals come from the percentile bootstrap (no normality
assumed), with a seeded RNG, at most `MAX_SAMPLES` samples per arm (evenly thinned, oldest to newest)
and `RESAMPLES` draws, so the cost per call is bounded. Arms are independent, so the interval of a
ratio treatment/control comes from pairing the i-th draw of each arm.

For a percentile we do not resample at all: the bootstrap distribution of a sample quantile is known
exactly. The nearest-rank q-quantile of a resample is <= x_(j) (the j-th smallest sample) iff at least
ceil(q·n) of the n draws are <= x_(j), a Binomial(n, j/n) event. We tabulate that CDF near rank q·n
and draw from it: the same law as resampling B times, in O(n) instead of O(B·n·log n). Throughput
(a mean of per-second token counts) is resampled the ordinary way.

Sample-ratio mismatch: a chi-square goodness-of-fit test of the arms' request counts against the
configured weights; p < 0.001 means assignment is broken and no verdict is given. The chi-square
survival function is exact for integer degrees of freedom (closed forms via `math.erfc`/`math.exp`).

A verdict names a winner only when an interval excludes "no difference", every arm has at least
`min_n` samples and there is no SRM. With two metrics at 95% each, identical arms still yield a
(false) verdict about 10% of the time; the verdict states n so a reader can judge.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .quantiles import nearest_rank

RESAMPLES = 1000
MAX_SAMPLES = 2000
LEVEL = 0.95
SRM_ALPHA = 0.001
MIN_N = 100


@dataclass(frozen=True, slots=True)
class ArmData:
    """What the A/B test needs from one arm over the window."""

    name: str
    weight: float
    requests: int
    ttft_s: Sequence[float]
    tpot_s: Sequence[float]
    tokens_per_s_series: Sequence[float]  # output tokens generated in each second of the window (zeros included)
    usd_per_hour: float | None


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square with integer `dof` (exact series, fine for the few arms we have)."""
    if dof < 1:
        raise ValueError("dof must be >= 1")
    if x <= 0:
        return 1.0
    half = x / 2.0
    if dof % 2 == 0:
        term = total = 1.0
        for i in range(1, dof // 2):
            term *= half / i
            total += term
        return min(1.0, math.exp(-half) * total)
    p = math.erfc(math.sqrt(half))
    term = math.sqrt(x) * math.exp(-half) / math.sqrt(math.pi / 2)  # = sqrt(2x/pi) e^{-x/2}
    for k in range(1, (dof - 1) // 2 + 1):
        p += term
        term *= x / (2 * k + 1)
    return min(1.0, p)


def srm(observed: Mapping[str, int], weights: Mapping[str, float]) -> dict[str, Any]:
    """Chi-square goodness of fit of observed counts to weights (arms with weight 0 must see nothing)."""
    total_w = sum(weights.get(a, 0.0) for a in observed)
    n = sum(observed.values())
    expected = {a: (n * weights.get(a, 0.0) / total_w if total_w > 0 else 0.0) for a in observed}
    chi2 = 0.0
    impossible = False
    for arm, obs in observed.items():
        exp = expected[arm]
        if exp > 0:
            chi2 += (obs - exp) ** 2 / exp
        elif obs > 0:
            impossible = True
    live = sum(1 for a in observed if expected[a] > 0)
    p = 0.0 if impossible else (chi2_sf(chi2, live - 1) if live > 1 and n > 0 else 1.0)
    return {
        "observed": dict(observed), "expected": expected, "chi2": chi2, "dof": max(live - 1, 0), "p_value": p,
        "flagged": p < SRM_ALPHA,
    }


def thin(values: Sequence[float], limit: int = MAX_SAMPLES) -> list[float]:
    """At most `limit` values, evenly spaced through the sequence (deterministic)."""
    n = len(values)
    if n <= limit:
        return list(values)
    return [values[(i * n) // limit] for i in range(limit)]


def median(values: Sequence[float]) -> float:
    return nearest_rank(sorted(values), 0.5)


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def bootstrap(values: Sequence[float], stat: Callable[[Sequence[float]], float], rng: random.Random,
              resamples: int = RESAMPLES) -> list[float]:
    n = len(values)
    return [stat(rng.choices(values, k=n)) for _ in range(resamples)]


def binom_sf(m: int, n: int, p: float) -> float:
    """P(X >= m) for X ~ Binomial(n, p); terms beyond 12 standard deviations are dropped (< 1e-30)."""
    if m <= 0 or p >= 1.0:
        return 1.0
    if m > n or p <= 0.0:
        return 0.0
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    hi = min(n, int(mean + 12 * sd + 2))
    if m > hi:
        return 0.0
    lo = max(m, int(mean - 12 * sd - 2))
    pmf = math.exp(math.lgamma(n + 1) - math.lgamma(lo + 1) - math.lgamma(n - lo + 1)
                   + lo * math.log(p) + (n - lo) * math.log1p(-p))
    ratio = p / (1 - p)
    total = 0.0
    for k in range(lo, hi + 1):
        total += pmf
        pmf *= (n - k) / (k + 1) * ratio
    return min(total, 1.0)


def quantile_bootstrap(values: Sequence[float], q: float, rng: random.Random,
                       resamples: int = RESAMPLES) -> list[float]:
    """`resamples` draws from the exact bootstrap distribution of the nearest-rank q-quantile."""
    xs = sorted(values)
    n = len(xs)
    m = max(math.ceil(q * n - 1e-9), 1)
    sd = math.sqrt(n * q * (1 - q)) + 1
    lo_j, hi_j = max(1, math.floor(m - 10 * sd)), min(n, math.ceil(m + 10 * sd))
    cdf = [binom_sf(m, n, j / n) for j in range(lo_j, hi_j + 1)]  # P(Q* <= x_(j)), nondecreasing in j
    cdf[-1] = 1.0
    return [xs[lo_j - 1 + bisect.bisect_left(cdf, rng.random())] for _ in range(resamples)]


def interval(draws: Sequence[float], level: float = LEVEL) -> tuple[float, float]:
    s = sorted(draws)
    tail = (1 - level) / 2
    return nearest_rank(s, tail), nearest_rank(s, 1 - tail)


@dataclass(frozen=True, slots=True)
class Metric:
    key: str
    label: str
    samples: Callable[[ArmData], Sequence[float]]
    stat: Callable[[Sequence[float]], float]
    draws: Callable[[Sequence[float], random.Random], list[float]]


METRICS = (
    Metric("ttft_p50_s", "TTFT p50", lambda a: a.ttft_s, median, lambda v, r: quantile_bootstrap(v, 0.5, r)),
    Metric("tpot_p50_s", "time per output token p50", lambda a: a.tpot_s, median,
           lambda v, r: quantile_bootstrap(v, 0.5, r)),
)
THROUGHPUT = Metric("output_tokens_per_s", "output tokens/s", lambda a: a.tokens_per_s_series, mean,
                    lambda v, r: bootstrap(v, mean, r))


def _pct(x: float) -> str:
    return f"{x * 100:.0f}"


def analyse(arms: Sequence[ArmData], *, min_n: int = MIN_N, seed: int = 0) -> dict[str, Any]:
    """Per-arm figures with CIs, each arm against the first (the control), SRM, and a verdict string."""
    rng = random.Random(seed)
    srm_result = srm({a.name: a.requests for a in arms}, {a.name: a.weight for a in arms})
    draws: dict[tuple[str, str], list[float]] = {}
    per_arm: list[dict[str, Any]] = []
    for a in arms:
        row: dict[str, Any] = {"arm": a.name, "weight": a.weight, "requests": a.requests, "n": len(a.ttft_s)}
        for m in (*METRICS, THROUGHPUT):
            vals = thin(m.samples(a))
            if not vals:
                row[m.key] = {"value": None, "ci95": None}
                continue
            d = draws[(a.name, m.key)] = m.draws(vals, rng)
            row[m.key] = {"value": m.stat(vals), "ci95": list(interval(d))}
        tps = row[THROUGHPUT.key]["value"]
        row["usd_per_million_output_tokens"] = _cost(a.usd_per_hour, tps)
        per_arm.append(row)

    control = arms[0] if arms else None
    comparisons: list[dict[str, Any]] = []
    clauses: dict[str, list[str]] = {}
    for t in arms[1:]:
        assert control is not None
        comp: dict[str, Any] = {"control": control.name, "treatment": t.name, "metrics": {}}
        for m in METRICS:
            dc, dt = draws.get((control.name, m.key)), draws.get((t.name, m.key))
            if not dc or not dt:
                continue
            ratios = [y / x for x, y in zip(dc, dt, strict=True) if x > 0]
            if len(ratios) < len(dc) // 2:
                continue
            lo, hi = interval(ratios)
            point = m.stat(thin(m.samples(t))) / max(m.stat(thin(m.samples(control))), 1e-12)
            comp["metrics"][m.key] = {"ratio": point, "relative_difference": point - 1,
                                      "ci95": [lo - 1, hi - 1], "significant": hi < 1 or lo > 1}
            if hi < 1:
                clauses.setdefault(t.name, []).append(
                    f"{m.label} {_pct(1 - point)}% lower (95% CI {_pct(1 - hi)}-{_pct(1 - lo)}%)")
            elif lo > 1:
                clauses.setdefault(control.name, []).append(
                    f"{m.label} {_pct(1 - 1 / point)}% lower (95% CI {_pct(1 - 1 / lo)}-{_pct(1 - 1 / hi)}%)")
        cost = _cost_ratio(control, t, draws)
        if cost is not None:
            cost["significant"] = cost["ci95"][1] < 1 or cost["ci95"][0] > 1
            comp["cost_ratio"] = cost  # treatment cost / control cost, with CI from the throughput bootstrap
            if cost["ci95"][1] < 1:
                clauses.setdefault(t.name, []).append(f"cost per 1M tokens {1 / cost['ratio']:.1f}x lower")
            elif cost["ci95"][0] > 1:
                clauses.setdefault(control.name, []).append(f"cost per 1M tokens {cost['ratio']:.1f}x lower")
        comparisons.append(comp)

    ns = [len(a.ttft_s) for a in arms]
    n_text = "/".join(f"{n:,}" for n in ns)
    if not arms or min(ns) < min_n:
        verdict = f"not enough data yet (n={n_text}, need {min_n:,} per arm)"
    elif srm_result["flagged"]:
        verdict = (f"sample ratio mismatch (p={srm_result['p_value']:.2g}): assignment does not match the "
                   f"configured weights; no verdict (n={n_text})")
    elif not clauses:
        verdict = f"no significant difference (n={n_text})"
    else:
        verdict = "; ".join(f"{name}: {', '.join(cl)}" for name, cl in clauses.items()) + f"; n={sum(ns):,}"
    return {"arms": per_arm, "comparisons": comparisons, "srm": srm_result, "verdict": verdict,
            "min_n": min_n, "resamples": RESAMPLES, "max_samples": MAX_SAMPLES}


def _cost(usd_per_hour: float | None, tps: float | None) -> float | None:
    if usd_per_hour is None or not tps:
        return None
    return usd_per_hour / (3600.0 * tps) * 1e6


def _cost_ratio(c: ArmData, t: ArmData, draws: Mapping[tuple[str, str], list[float]]) -> dict[str, Any] | None:
    dc, dt = draws.get((c.name, THROUGHPUT.key)), draws.get((t.name, THROUGHPUT.key))
    if not dc or not dt or not c.usd_per_hour or not t.usd_per_hour:
        return None
    price = t.usd_per_hour / c.usd_per_hour
    ratios = [price * x / y for x, y in zip(dc, dt, strict=True) if y > 0]
    if len(ratios) < len(dc) // 2:
        return None
    tc, tt = mean(c.tokens_per_s_series), mean(t.tokens_per_s_series)
    if tt <= 0 or tc <= 0:
        return None
    lo, hi = interval(ratios)
    return {"ratio": price * tc / tt, "ci95": [lo, hi]}
