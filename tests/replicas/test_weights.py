"""Live A/B weights are one setting for the fleet: a change on one replica is in force on every
replica within a second, on every worker of each, and survives a replica's restart."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.integration.harness import Emulators, GatewayProcess, backend_entry, wait_for

from .conftest import Replicas
from .redis_server import RedisServer


def split_config(emulators: Emulators, vllm_weight: float = 50) -> dict[str, Any]:
    v, s = emulators.start("vllm"), emulators.start("sglang")
    return {
        "backends": [backend_entry("v", v, "vllm"), backend_entry("s", s, "sglang")],
        "routes": [{"model": "ab", "split": {"arms": [{"name": "vllm", "weight": vllm_weight, "backends": ["v"]},
                                                      {"name": "sglang", "weight": 50, "backends": ["s"]}]}}],
        "health": {"interval_s": 0.5},
    }


def weights(gw: GatewayProcess) -> dict[str, float]:
    with httpx.Client(timeout=10) as client:
        found: dict[str, float] = client.get(gw.url + "/admin/routes/ab/weights").json()["weights"]
        return found


def put(gw: GatewayProcess, **arms: float) -> httpx.Response:
    with httpx.Client(timeout=30) as client:
        return client.put(gw.url + "/admin/routes/ab/weights", json={"weights": arms})


def test_a_change_on_one_replica_is_in_force_on_all_within_a_second(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    cfg = split_config(emulators)
    a, b = replicas(cfg, 2, redis=redis)
    (c,) = replicas(cfg, 1, redis=redis, workers=2)  # and on every worker of a supervised replica
    changed = time.monotonic()
    assert put(a, vllm=10, sglang=90).status_code == 200
    target = {"vllm": 10.0, "sglang": 90.0}
    for gw in (b, c):
        wait_for(lambda gw=gw: weights(gw), lambda w: w == target, timeout=5, what="the new weights")  # type: ignore[misc]
    took = time.monotonic() - changed
    assert took < 1.0, f"{took:.2f} s to reach every replica"
    assert all(weights(c) == target for _ in range(10))  # whichever worker answers
    # the other way round, and a second change supersedes the first
    assert put(c, vllm=70, sglang=30).status_code == 200
    for gw in (a, b):
        wait_for(lambda gw=gw: weights(gw), lambda w: w == {"vllm": 70.0, "sglang": 30.0}, timeout=5,  # type: ignore[misc]
                 what="the second change")


def test_shared_weights_survive_a_replica_restart(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    cfg = split_config(emulators)
    a, b = replicas(cfg, 2, redis=redis)
    assert put(a, vllm=5, sglang=95).status_code == 200
    wait_for(lambda: weights(b), lambda w: w == {"vllm": 5.0, "sglang": 95.0}, timeout=5, what="b has the change")
    a.stop()
    b.stop()
    (fresh,) = replicas(cfg, 1, redis=redis)  # a new process: the file says 50/50, the fleet says 5/95
    assert weights(fresh) == {"vllm": 5.0, "sglang": 95.0}  # in force from its first request on


def test_a_replica_whose_split_differs_keeps_its_own_weights(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    (a,) = replicas(split_config(emulators), 1, redis=redis)
    (other,) = replicas(split_config(emulators, vllm_weight=20), 1, redis=redis)  # another experiment
    (same,) = replicas(split_config(emulators), 1, redis=redis)
    assert put(a, vllm=1, sglang=99).status_code == 200
    wait_for(lambda: weights(same), lambda w: w == {"vllm": 1.0, "sglang": 99.0}, timeout=5, what="same split")
    assert weights(other) == {"vllm": 20.0, "sglang": 50.0}
