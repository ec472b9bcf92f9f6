"""Without any shared state, replicas place a prefix nobody holds yet on the same backend
(rendezvous hashing over the backend names): routing memory stays per replica, placement agrees."""

from __future__ import annotations

import httpx

from tests.integration.harness import Emulators, GatewayProcess, backend_entry

from .conftest import Replicas


def backend_for(gw: GatewayProcess, prompt: str) -> str:
    with httpx.Client(timeout=30) as client:
        r = client.post(gw.url + "/v1/chat/completions",
                        json={"model": "moe", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1})
        assert r.status_code == 200
        return r.headers["x-gateway-backend"]


def test_two_replicas_without_a_store_agree_on_new_prefixes(emulators: Emulators, replicas: Replicas) -> None:
    names = ["a", "b", "c", "d"]
    backends = [backend_entry(n, emulators.start("vllm"), "vllm") for n in names]
    one, two = replicas({"backends": backends, "routes": [{"model": "moe", "backends": names,
                                                           "policy": "prefix_affinity"}]}, 2)
    prompts = [f"tenant {i:03d}: " + "the same long system prompt for this tenant " * 8 for i in range(24)]
    first = [backend_for(one, p) for p in prompts]
    second = [backend_for(two, p) for p in prompts]
    agree = sum(x == y for x, y in zip(first, second, strict=True))
    assert agree >= 22, list(zip(first, second, strict=True))  # (a backend busy at that instant may spill one)
    assert len(set(first)) >= 3  # and the prefixes really spread over the fleet
