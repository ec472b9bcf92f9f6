"""Outlier ejection on completed requests (pure: time is an argument)."""

from __future__ import annotations

from backends.base import Runtime
from backends.registry import adapter_for
from gateway.settings import Backend
from gateway.state.outliers import OutlierRules
from gateway.state.pool import BackendState, Pool


def pool(n: int = 3, **rules: float) -> Pool:
    states = [
        BackendState(Backend(name=f"b{i}", runtime=Runtime.VLLM, url=f"http://127.0.0.1:{i + 1}", model="m"),
                     adapter_for(Runtime.VLLM))
        for i in range(n)
    ]
    return Pool(states, rules=OutlierRules(**rules))  # type: ignore[arg-type]


def test_consecutive_failures_eject_and_a_success_resets_the_run() -> None:
    p = pool(consecutive=3, min_requests=1000)
    for ok in (False, False, True, False, False):
        assert p.judge("b0", ok, 0.0).eject_for_s is None
    verdict = p.judge("b0", False, 1.0, "reset")
    assert verdict.eject_for_s == 5.0
    assert not p["b0"].healthy
    assert p["b0"].last_error == "reset"


def test_a_high_failure_rate_ejects_even_when_successes_interleave() -> None:
    """Every other request fails: no run of consecutive failures, but half of them in the window."""
    p = pool(consecutive=100, failure_rate=0.5, min_requests=10, window_s=30.0)
    verdicts = [p.judge("b0", i % 2 == 0, i * 0.1) for i in range(20)]
    ejected = [i for i, v in enumerate(verdicts) if v.eject_for_s is not None]
    assert ejected == [9]  # the 10th judged request: 5 of 10 failed
    assert not p["b0"].healthy


def test_old_failures_leave_the_window() -> None:
    p = pool(consecutive=100, failure_rate=0.5, min_requests=4, window_s=10.0)
    for t in range(3):
        p.judge("b0", False, float(t))
    for t in range(20, 23):
        assert p.judge("b0", True, float(t)).eject_for_s is None
    assert p.judge("b0", False, 23.0).eject_for_s is None  # 1 of 4 in the window
    assert p["b0"].healthy


def test_a_passing_probe_readmits_only_after_the_ejection_time() -> None:
    p = pool(consecutive=1, base_ejection_s=5.0)
    p.judge("b0", False, 10.0, "boom")
    p.record_probe("b0", True, 12.0)
    assert not p["b0"].healthy
    p.record_probe("b0", True, 15.0)
    assert p["b0"].healthy
    assert p["b0"].consecutive_failures == 0


def test_repeat_offences_eject_for_longer_and_a_clean_stretch_forgives() -> None:
    p = pool(consecutive=1, base_ejection_s=5.0, max_ejection_s=12.0)
    lengths = []
    now = 0.0
    for _ in range(4):
        lengths.append(p.judge("b0", False, now).eject_for_s)
        assert p["b0"].ejected_until is not None
        now = p["b0"].ejected_until
        p.record_probe("b0", True, now)
        assert p["b0"].healthy
    assert lengths == [5.0, 10.0, 12.0, 12.0]  # grows, capped
    assert p.judge("b0", False, now + 12.0).eject_for_s == 5.0  # in for max_ejection_s: starts again at one


def test_never_more_than_the_share_of_the_fleet_and_never_the_last_backend() -> None:
    p = pool(n=4, consecutive=1, max_ejected_share=0.5)
    assert p.judge("b0", False, 0.0).eject_for_s is not None
    assert p.judge("b1", False, 0.0).eject_for_s is not None
    spared = p.judge("b2", False, 0.0)
    assert spared.eject_for_s is None
    assert spared.spared  # a third of four would exceed half the fleet
    assert p["b2"].healthy

    alone = pool(n=1, consecutive=1)
    assert alone.judge("b0", False, 0.0).spared
    assert alone.any_healthy()


def test_a_failing_probe_marks_unhealthy_and_a_passing_one_restores() -> None:
    p = pool()
    p.record_probe("b0", False, 1.0, "503")
    assert not p["b0"].healthy
    assert p["b0"].last_error == "503"
    p.record_probe("b0", True, 2.0)
    assert p["b0"].healthy
