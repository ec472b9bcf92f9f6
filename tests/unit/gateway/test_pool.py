from __future__ import annotations

from backends.base import Runtime
from backends.registry import adapter_for
from gateway.settings import Backend
from gateway.state.pool import BackendState, Pool


def pool(threshold: int = 3, cooldown: float = 5.0) -> Pool:
    cfg = Backend(name="a", runtime=Runtime.VLLM, url="http://127.0.0.1:1", model="m")
    return Pool([BackendState(cfg, adapter_for(Runtime.VLLM))], failure_threshold=threshold, cooldown_s=cooldown)


def test_consecutive_failures_eject_and_success_resets_the_count() -> None:
    p = pool(threshold=3)
    assert not p.record_failure("a", 0.0, "x")
    assert not p.record_failure("a", 0.0, "x")
    p.record_success("a")
    assert not p.record_failure("a", 0.0, "x")
    assert not p.record_failure("a", 0.0, "x")
    assert p.record_failure("a", 1.0, "x")
    assert not p["a"].healthy
    assert not p.any_healthy()


def test_a_passing_probe_readmits_only_after_the_cooldown() -> None:
    p = pool(threshold=1, cooldown=5.0)
    p.record_failure("a", 10.0, "boom")
    p.record_probe("a", True, 12.0)
    assert not p["a"].healthy
    p.record_probe("a", True, 15.0)
    assert p["a"].healthy
    assert p["a"].consecutive_failures == 0


def test_a_failing_probe_marks_unhealthy_and_a_passing_one_restores() -> None:
    p = pool()
    p.record_probe("a", False, 1.0, "503")
    assert not p["a"].healthy
    assert p["a"].last_error == "503"
    p.record_probe("a", True, 2.0)
    assert p["a"].healthy
