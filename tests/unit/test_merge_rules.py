"""Every metric family a gateway exports declares how its workers' values merge (`gateway.merge_rules`),
where it is defined: nothing is summed by default. Checked on a real gateway built with every feature
that registers families (KV events, discovery, the shared store, API keys, an A/B split with a
shadow arm, prices) and on a supervisor's hub."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.access.secrets import hash_key
from gateway.app import build, build_pool
from gateway.cluster.committed import Committed
from gateway.cluster.hub import Hub
from gateway.merge_rules import COUNTER_RULES, Merge, declare, declared, rule_of
from gateway.settings import Settings, parse_settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def everything() -> Settings:
    return parse_settings({
        "backends": [
            {"name": "v", "runtime": "vllm", "url": "http://127.0.0.1:9", "model": "m", "usd_per_hour": 10.0,
             "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}", "bind": True}},
            {"name": "t", "runtime": "trtllm", "url": "http://127.0.0.1:9", "model": "m", "kv_events": {}},
            {"name": "s", "runtime": "sglang", "url": "http://127.0.0.1:9", "model": "m"},
        ],
        "discovery": [{"name": "pool", "runtime": "vllm", "model": "m",
                       "dns": {"host": "pool.test", "port": 8000, "resolver": f"127.0.0.1:{free_port()}"}}],
        "routes": [
            {"model": "m", "backends": ["v", "t", "s", "pool"]},
            {"model": "ab", "split": {"arms": [{"name": "a", "weight": 1, "backends": ["v"]},
                                                {"name": "b", "weight": 1, "backends": ["s"]}],
                                       "shadow": {"arm": "b", "fraction": 0.5}}},
        ],
        "auth": {"api_keys": [{"id": "k", "key": hash_key("sk-k"), "requests_per_minute": 5}]},
        "state": {"redis_url": f"redis://127.0.0.1:{free_port()}"},
        "tracing": {"otlp_endpoint": f"127.0.0.1:{free_port()}"},
    })


@pytest.fixture
async def gateway_registry() -> AsyncIterator[CollectorRegistry]:
    registry = CollectorRegistry()
    built = await build(everything(), registry=registry)
    runner = web.AppRunner(built.app)
    await runner.setup()  # (its lifetime runs: probes, the store, discovery, as when serving)
    try:
        yield registry
    finally:
        await runner.cleanup()


def families(registry: CollectorRegistry) -> dict[str, str]:
    return {m.name: m.type for m in registry.collect()}


async def test_every_family_of_a_fully_configured_gateway_declares_its_merge_rule(
    gateway_registry: CollectorRegistry,
) -> None:
    hub = Hub(Committed.first(everything()), config_path=None, build_pool=build_pool)
    found = {**families(gateway_registry), **families(hub.registry)}
    assert {"gateway_kv_events_live", "gateway_discovery_endpoints", "gateway_state_store_up", "gateway_key_requests",
            "gateway_backend_cost_per_million_tokens_usd", "gateway_workers", "process_open_fds",
            "gateway_tracing_spans_dropped"} <= set(found)
    undeclared = sorted(name for name in found if rule_of(name) is None)
    assert undeclared == [], "declare a merge rule where the family is defined (gateway.merge_rules)"
    counters = {name: rule_of(name) for name, kind in found.items() if kind in ("counter", "histogram", "summary")}
    assert {name: rule for name, rule in counters.items() if rule not in COUNTER_RULES} == {}
    ours = {name for name in declared() if name.startswith(("gateway_", "gen_ai_", "process_"))}
    assert sorted(ours - set(found)) == [], "a declared family that no gateway exports: renamed or gone?"


def test_a_family_declared_twice_with_two_rules_is_refused() -> None:
    declare(Merge.MAX, "test_twice")
    declare(Merge.MAX, "test_twice_total")  # the same family, as a counter is named when defined
    assert rule_of("test_twice") is Merge.MAX
    with pytest.raises(ValueError, match="test_twice: merge rule sum declared, but it was declared max before"):
        declare(Merge.SUM, "test_twice")
