"""Per-key limits across replicas: one budget in Redis, whichever replica each request reaches."""

from __future__ import annotations

import itertools
import time
from typing import Any

import httpx
import pytest

from gateway.access.secrets import hash_key
from tests.integration.harness import Emulators, GatewayProcess, backend_entry

from .conftest import Replicas
from .redis_server import RedisServer

KEY = "sk-shared"


def config(emulators: Emulators, **limits: int) -> dict[str, Any]:
    emu = emulators.start("vllm")
    return {
        "backends": [backend_entry("v", emu, "vllm")],
        "routes": [{"model": "moe", "backends": ["v"]}],
        "health": {"interval_s": 0.5},
        "auth": {"api_keys": [{"id": "team", "key": hash_key(KEY), **limits}]},
    }


def chat(gw: GatewayProcess, max_tokens: int = 2) -> httpx.Response:
    with httpx.Client(timeout=30) as client:  # a new connection each time
        return client.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "moe", "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": max_tokens})


def test_the_request_budget_is_the_configured_one_across_three_replicas(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    """120 requests a minute (a burst of 120, then 2 a second), 300 requests spread over three
    replicas as fast as they go: granted = 120 + 2 x the seconds it took, within 5%."""
    gateways = replicas(config(emulators, requests_per_minute=120), 3, redis=redis)
    codes: dict[int, int] = {}
    started = time.monotonic()
    for gw in itertools.islice(itertools.cycle(gateways), 300):
        status = chat(gw).status_code
        codes[status] = codes.get(status, 0) + 1
    elapsed = time.monotonic() - started
    assert set(codes) <= {200, 429}
    budget = 120 + 2 * elapsed
    assert codes[200] == pytest.approx(budget, rel=0.05), (codes, elapsed)
    assert codes[200] < 2 * 120  # not the per-replica budget three times over


def test_a_refusal_says_when_to_retry_and_which_budget(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    a, b = replicas(config(emulators, requests_per_minute=2), 2, redis=redis)
    first, second = chat(a), chat(b)
    assert (first.status_code, second.status_code) == (200, 200)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"  # b sees what a spent: one bucket
    refused = chat(a)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "requests"
    assert 1 <= int(refused.headers["Retry-After"]) <= 30  # one request refills in 30 s


def test_tokens_spent_on_one_replica_are_spent_on_all(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    a, b = replicas(config(emulators, tokens_per_minute=60), 2, redis=redis)
    spent = 0
    while spent < 60:  # each answer's usage is charged to the shared bucket
        reply = chat(a, max_tokens=16)
        assert reply.status_code == 200
        usage = reply.json()["usage"]
        spent += usage["prompt_tokens"] + usage["completion_tokens"]
    refused = None
    deadline = time.monotonic() + 5  # charges are written in batches every 20 ms
    while time.monotonic() < deadline:
        refused = chat(b)
        if refused.status_code == 429:
            break
    assert refused is not None
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "tokens"


def test_replicas_that_disagree_on_a_keys_limit_still_share_one_budget(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    """A rolling deploy that changes a key's limit: one replica says 5 a minute, the other 6. The
    shared bucket is rescaled at each flip, never read as full: 30 requests alternating between them
    get about one budget (5 or 6, and what refilled meanwhile), not 30 of 30."""
    (five,) = replicas(config(emulators, requests_per_minute=5), 1, redis=redis)
    (six,) = replicas(config(emulators, requests_per_minute=6), 1, redis=redis)
    started = time.monotonic()
    codes = [chat(gw).status_code for gw in itertools.islice(itertools.cycle((five, six)), 30)]
    elapsed = time.monotonic() - started
    assert set(codes) <= {200, 429}
    assert 5 <= codes.count(200) <= 6 + elapsed * 6 / 60 + 1, (codes, elapsed)

