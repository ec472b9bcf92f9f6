"""A/B logic against synthetic arms whose ground truth is known."""

from __future__ import annotations

import math
import random
import time
from typing import Any

import pytest

from gateway.stats.ab import ArmData, analyse, binom_sf, chi2_sf, median, quantile_bootstrap, srm


@pytest.mark.parametrize(("x", "dof", "p"), [
    (3.841458820694124, 1, 0.05), (6.6348966010212145, 1, 0.01), (5.991464547107979, 2, 0.05),
    (7.814727903251178, 3, 0.05), (9.487729036781154, 4, 0.05), (11.070497693516351, 5, 0.05),
    (16.26623619623813, 3, 0.001), (0.0, 3, 1.0),
])
def test_chi2_survival_function_matches_tables(x: float, dof: int, p: float) -> None:
    assert chi2_sf(x, dof) == pytest.approx(p, rel=1e-9)


def arm(name: str, n: int, *, scale: float, seed: int, weight: float = 1.0, usd: float | None = 96.0,
        tokens_per_s: float = 100.0, requests: int | None = None) -> ArmData:
    """Log-normal (skewed) TTFT and TPOT with median `scale`x a reference; steady throughput."""
    rng = random.Random(seed)
    return ArmData(
        name=name, weight=weight, requests=n if requests is None else requests,
        ttft_s=[0.2 * scale * math.exp(rng.gauss(0, 0.6)) for _ in range(n)],
        tpot_s=[0.03 * scale * math.exp(rng.gauss(0, 0.4)) for _ in range(n)],
        tokens_per_s_series=[max(tokens_per_s + rng.gauss(0, tokens_per_s / 10), 0) for _ in range(60)],
        usd_per_hour=usd,
    )


def test_a_clearly_faster_cheaper_arm_is_named_with_a_ci_that_holds_the_truth() -> None:
    result = analyse([arm("vllm", 800, scale=1.0, seed=1),
                      arm("sglang", 800, scale=0.6, seed=2, tokens_per_s=200.0)])
    comp = result["comparisons"][0]
    ttft = comp["metrics"]["ttft_p50_s"]
    lo, hi = ttft["ci95"]
    assert lo < -0.4 < hi < 0  # truth: 40% lower
    assert comp["cost_ratio"]["ci95"][0] < 0.5 < comp["cost_ratio"]["ci95"][1]  # truth: half the cost
    v = result["verdict"]
    assert v.startswith("sglang: TTFT p50 ")
    assert "% lower (95% CI " in v
    assert "cost per 1M tokens 2.0x lower" in v
    assert v.endswith("n=1,600")
    assert not result["srm"]["flagged"]


def test_the_control_can_win_too() -> None:
    result = analyse([arm("a", 500, scale=0.5, seed=3), arm("b", 500, scale=1.0, seed=4)])
    lo, hi = result["comparisons"][0]["metrics"]["ttft_p50_s"]["ci95"]
    assert lo < 1.0 < hi  # truth: b's TTFT is 2x a's (+100%), i.e. a's is 50% lower
    assert result["verdict"].startswith("a: TTFT p50 ")
    assert "b:" not in result["verdict"]


def test_identical_arms_give_no_verdict() -> None:
    result = analyse([arm("a", 600, scale=1.0, seed=5), arm("b", 600, scale=1.0, seed=6)])
    assert result["verdict"] == "no significant difference (n=600/600)"
    lo, hi = result["comparisons"][0]["metrics"]["ttft_p50_s"]["ci95"]
    assert lo < 0 < hi


def test_too_few_samples_give_no_verdict_whatever_the_difference() -> None:
    result = analyse([arm("a", 40, scale=1.0, seed=7), arm("b", 40, scale=0.3, seed=8)])
    assert result["verdict"] == "not enough data yet (n=40/40, need 100 per arm)"


def test_skewed_assignment_is_flagged_and_blocks_the_verdict() -> None:
    result = analyse([arm("a", 700, scale=1.0, seed=9), arm("b", 300, scale=0.5, seed=10)])  # weights 1:1
    assert result["srm"]["flagged"]
    assert result["srm"]["p_value"] < 1e-6
    assert result["verdict"].startswith("sample ratio mismatch")


def test_srm_accepts_counts_that_fit_the_weights() -> None:
    r: dict[str, Any] = srm({"a": 905, "b": 95}, {"a": 9, "b": 1})
    assert r["expected"] == {"a": 900.0, "b": 100.0}
    assert r["chi2"] == pytest.approx(25 / 900 + 25 / 100)
    assert not r["flagged"]
    assert srm({"a": 10, "b": 1}, {"a": 1, "b": 0})["flagged"]  # a zero-weight arm saw traffic


def test_bootstrap_is_seeded_and_bounded() -> None:
    arms = [arm("a", 5000, scale=1.0, seed=11), arm("b", 5000, scale=0.9, seed=12)]
    started = time.perf_counter()
    first = analyse(arms)
    elapsed = time.perf_counter() - started
    assert analyse(arms) == first
    assert elapsed < 5.0


def test_the_exact_quantile_bootstrap_has_the_law_of_ordinary_resampling() -> None:
    rng = random.Random(13)
    values = [math.exp(rng.gauss(0, 1)) for _ in range(301)]
    exact = sorted(quantile_bootstrap(values, 0.5, random.Random(1), resamples=4000))
    resampler = random.Random(2)
    naive = sorted(median(resampler.choices(values, k=len(values))) for _ in range(4000))
    for q in (0.025, 0.25, 0.5, 0.75, 0.975):
        i = int(q * 4000)
        assert abs(sorted(values).index(exact[i]) - sorted(values).index(naive[i])) <= 2  # within 2 ranks


def test_binomial_tail() -> None:
    assert binom_sf(3, 4, 0.5) == pytest.approx(5 / 16)
    assert binom_sf(0, 10, 0.3) == 1.0
    assert binom_sf(11, 10, 0.3) == 0.0
    assert binom_sf(500, 1000, 0.5) == pytest.approx(0.5 + 0.5 * math.comb(1000, 500) / 2**1000)
