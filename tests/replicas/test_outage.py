"""Redis down or unreachable: requests keep flowing on local state, `gateway_state_store_up` reads 0,
one error is logged per outage, and everything reconnects by itself. No request fails because Redis
did."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.access.secrets import hash_key
from tests.integration.harness import Emulators, GatewayProcess, backend_entry, wait_for

from .conftest import Replicas
from .redis_server import RedisServer, free_port

KEY = "sk-outage"
UNREACHABLE = "is unreachable"


def config(emulators: Emulators) -> dict[str, Any]:
    v, s = emulators.start("vllm"), emulators.start("sglang")
    return {
        "backends": [backend_entry("v", v, "vllm"), backend_entry("s", s, "sglang")],
        "routes": [{"model": "ab", "split": {"arms": [{"name": "vllm", "weight": 50, "backends": ["v"]},
                                                      {"name": "sglang", "weight": 50, "backends": ["s"]}]}}],
        "health": {"interval_s": 0.5},
        "auth": {"api_keys": [{"id": "team", "key": hash_key(KEY), "requests_per_minute": 1000,
                               "tokens_per_minute": 1_000_000}]},
    }


def chat(gw: GatewayProcess) -> int:
    with httpx.Client(timeout=30) as client:
        return client.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "ab", "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2}).status_code


def gauge(gw: GatewayProcess, name: str = "gateway_state_store_up") -> float:
    with httpx.Client(timeout=30) as client:
        text = client.get(gw.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def weights(gw: GatewayProcess) -> dict[str, float]:
    with httpx.Client(timeout=10) as client:
        found: dict[str, float] = client.get(gw.url + "/admin/routes/ab/weights").json()["weights"]
        return found


def errors_logged(gw: GatewayProcess) -> int:
    return sum(1 for line in gw.log_path.read_text().splitlines() if " ERROR " in line and UNREACHABLE in line)


def test_an_outage_serves_on_local_state_logs_once_and_heals(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    cfg = config(emulators)
    (a,) = replicas(cfg, 1, redis=redis)
    (b,) = replicas(cfg, 1, redis=redis, workers=2)
    assert [chat(gw) for gw in (a, b) for _ in range(4)] == [200] * 8
    assert gauge(a) == 1
    assert gauge(b) == 1  # (the hub's and both workers' stores)
    redis.stop()
    statuses = [chat(gw) for gw in (a, b) for _ in range(10)]  # limits now on local buckets
    assert statuses == [200] * 20
    wait_for(lambda: (gauge(a), gauge(b)), lambda g: g == (0, 0), timeout=10, what="the gauge at 0")
    changed = httpx.put(a.url + "/admin/routes/ab/weights", json={"weights": {"vllm": 3, "sglang": 97}}, timeout=30)
    assert changed.status_code == 200  # applied here at once, written to the store once it is back
    assert weights(a) == {"vllm": 3.0, "sglang": 97.0}
    fleet = httpx.get(a.url + "/admin/compare?window=60&scope=fleet", timeout=30).json()
    assert [r["replica"] for r in fleet["replicas"]] == ["replica-0"]  # the fleet view degrades to this one
    assert gauge(a, "gateway_state_store_fallbacks_total") > 0
    assert [chat(gw) for gw in (a, b) for _ in range(4)] == [200] * 8
    assert errors_logged(a) == 1  # one error for the whole outage, however many requests it saw
    assert errors_logged(b) == 1  # one for the supervised replica (its workers log at INFO)
    redis.start()  # the same port: the gateways find it again by themselves
    wait_for(lambda: (gauge(a), gauge(b)), lambda g: g == (1, 1), timeout=20, what="the gauge back at 1")
    wait_for(lambda: weights(b), lambda w: w == {"vllm": 3.0, "sglang": 97.0}, timeout=10,
             what="the change made during the outage reaching b")
    assert [chat(gw) for gw in (a, b) for _ in range(4)] == [200] * 8
    assert "reachable again" in a.log_path.read_text()
    assert errors_logged(a) == 1


def test_a_store_that_is_not_there_at_start_costs_nothing(
    emulators: Emulators, replicas: Replicas, tmp_path: Any,
) -> None:
    nowhere = RedisServer(tmp_path, port=free_port())  # never started
    (gw,) = replicas(config(emulators), 1, redis=nowhere, timeout_s=0.1)
    assert [chat(gw) for _ in range(5)] == [200] * 5
    assert gauge(gw) == 0
    assert weights(gw) == {"vllm": 50.0, "sglang": 50.0}
    assert httpx.put(gw.url + "/admin/routes/ab/weights", json={"weights": {"vllm": 1}},
                     timeout=30).status_code == 200
    assert errors_logged(gw) == 1
    nowhere.start()  # and it joins the fleet once Redis appears
    try:
        wait_for(lambda: gauge(gw), lambda up: up == 1, timeout=20, what="the store found")
    finally:
        nowhere.stop()
