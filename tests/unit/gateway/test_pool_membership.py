"""Discovered backends in a pool: joining (not ready until probed), draining, leaving; routes and
arms that name a discovery pool (pure: no I/O, time is an argument)."""

from __future__ import annotations

from backends.base import Runtime
from backends.registry import adapter_for
from gateway.settings import Backend
from gateway.state.pool import STATIC, BackendState, Pool


def state(name: str, *, source: str = STATIC, probe_ok: bool = True) -> BackendState:
    config = Backend(name=name, runtime=Runtime.VLLM, url="http://127.0.0.1:9", model="m")
    return BackendState(config, adapter_for(Runtime.VLLM), probe_ok=probe_ok, source=source)


def pool() -> Pool:
    return Pool([state("s"), state("pool-127.0.0.2:80", source="pool")], groups=["pool", "empty"])


def test_a_route_naming_a_pool_gets_its_members_and_an_empty_pool_none() -> None:
    p = pool()
    assert p.expand(["s", "pool"]) == ["s", "pool-127.0.0.2:80"]
    assert p.expand(("empty", "s")) == ["s"]
    assert p.groups() == {"pool": ["pool-127.0.0.2:80"], "empty": []}


def test_a_joining_backend_is_a_member_at_once_but_routable_only_once_probed() -> None:
    p = pool()
    before = p.expand(["pool"])
    joined = p.join(state("pool-127.0.0.3:80", source="pool", probe_ok=False))
    assert joined is not None
    assert p.expand(["pool"]) == ["pool-127.0.0.2:80", "pool-127.0.0.3:80"]
    assert before == ["pool-127.0.0.2:80"]  # an expansion already handed out does not change
    view = {v.name: v.healthy for v in p.snapshot(p.expand(["pool"])).backends}
    assert view == {"pool-127.0.0.2:80": True, "pool-127.0.0.3:80": False}
    p.record_probe("pool-127.0.0.3:80", True, 1.0)
    assert p["pool-127.0.0.3:80"].healthy


def test_a_draining_backend_leaves_every_route_at_once_and_the_pool_once_removed() -> None:
    p = pool()
    p["pool-127.0.0.2:80"].in_flight = 2
    drained = p.drain("pool-127.0.0.2:80", 5.0)
    assert drained is not None
    assert drained.draining
    assert drained.draining_since == 5.0
    assert p.expand(["s", "pool"]) == ["s"]
    assert not drained.healthy
    assert "pool-127.0.0.2:80" in [s.name for s in p]  # still here: its requests are finishing
    assert p.drain("pool-127.0.0.2:80", 6.0) is None  # once
    assert p.remove("s") is None  # only draining backends are removed
    assert p.remove("pool-127.0.0.2:80") is drained
    assert [s.name for s in p] == ["s"]


def test_late_probes_loads_and_verdicts_for_a_removed_backend_are_ignored() -> None:
    p = pool()
    p.drain("pool-127.0.0.2:80", 0.0)
    p.remove("pool-127.0.0.2:80")
    p.record_probe("pool-127.0.0.2:80", False, 1.0, "gone")
    verdict = p.judge("pool-127.0.0.2:80", False, 1.0, "reset")
    assert verdict.eject_for_s is None
    assert not verdict.spared


def test_a_backend_back_while_draining_is_taken_back_not_ready_and_a_taken_name_is_refused() -> None:
    p = pool()
    old = p["pool-127.0.0.2:80"]
    old.in_flight = 1
    p.drain(old.name, 0.0)
    back = p.join(state(old.name, source="pool"))
    assert back is old  # its in-flight count and outlier record carry on
    assert not old.draining
    assert not old.probe_ok
    assert old.in_flight == 1
    assert p.expand(["pool"]) == [old.name]
    assert p.join(state("s", source="pool")) is None  # a static backend's name
    assert p.join(state(old.name, source="pool")) is None  # already a member
    assert p.join(state("x", source="unknown")) is None  # not a configured pool


def test_arms_see_a_pool_as_healthy_while_one_member_is() -> None:
    p = pool()
    assert p.healthy_names() == {"s", "pool-127.0.0.2:80", "pool"}
    p.record_probe("pool-127.0.0.2:80", False, 1.0)
    assert p.healthy_names() == {"s"}
    p.join(state("pool-127.0.0.3:80", source="pool"))
    assert "pool" in p.healthy_names()
    assert "empty" not in p.healthy_names()


def test_a_pool_without_discovery_hands_back_the_route_list_itself() -> None:
    p = Pool([state("a"), state("b")])
    names = ["a", "b"]
    assert p.expand(names) is names  # no copy on the request path when nothing is discovered
    assert p.expand(("a",)) == ["a"]
