"""Data-parallel ranks' pure parts (issue 23): config rules, pinning bytes, the client's rank fields,
per-rank views and exclusion, per-rank load from the engines' metrics, and the per-rank KV index."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from backends.base import Endpoint, Load, Runtime, UpstreamRequest
from backends.ranks import RANK_HEADER, pinned, rank_pin
from backends.registry import adapter_for
from gateway.discovery.config import DiscoveryEntry
from gateway.discovery.endpoints import Endpoint as Address
from gateway.discovery.endpoints import discovered
from gateway.kvcache import KvCaches
from gateway.kvcache.events import Batch, Stored
from gateway.proxy.request import parse_request
from gateway.rank_settings import unit_backend, unit_name
from gateway.routing import POLICIES, RequestFeatures, RouteRequest, RoutingState
from gateway.routing.tokens import TokenPrompt
from gateway.settings import Backend, ConfigError, parse_settings
from gateway.state.health_feed import Finding
from gateway.state.pool import BackendState, Pool

WIDE = {"name": "wide", "runtime": "vllm", "url": "http://127.0.0.1:1", "model": "m", "data_parallel_size": 4}
RNG = random.Random(0)


def settings(*backends: dict[str, Any]) -> Any:
    return parse_settings({"backends": list(backends), "routes": [{"model": "m", "backends": [b["name"]
                                                                                          for b in backends]}]})


@pytest.mark.parametrize(("patch", "needle"), [
    ({"runtime": "trtllm"}, "data_parallel_size: trtllm-serve"),
    ({"runtime": "triton"}, "data_parallel_size: Triton"),
    ({"dp_rank_field": "routed_dp_rank"}, "dp_rank_field: only SGLang"),
    ({"kv_events": {"endpoint": "tcp://127.0.0.1:5557", "data_parallel_size": 2}}, "kv_events.data_parallel_size"),
    ({"data_parallel_size": 0}, "backends.0.data_parallel_size"),
    ({"data_parallel_size": 65}, "backends.0.data_parallel_size"),
])
def test_ranks_that_cannot_be_pinned_are_refused(patch: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        settings({**WIDE, **patch})


def test_kv_events_ranks_default_to_the_servers() -> None:
    s = settings({**WIDE, "kv_events": {"endpoint": "tcp://127.0.0.1:5557"}})
    assert s.backends[0].kv_events is not None
    assert s.backends[0].kv_events.data_parallel_size == 4
    one = settings({**WIDE, "data_parallel_size": 1, "runtime": "trtllm"})  # one rank: any runtime
    assert one.backends[0].data_parallel_size == 1


def test_vllm_pins_by_header_and_sglang_by_a_body_field() -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    up = UpstreamRequest("/v1/chat/completions", body, {"x-request-id": "r"})
    vllm = rank_pin(Runtime.VLLM)
    assert vllm is not None
    header = pinned(up, vllm, 3)
    assert header.headers == {"x-request-id": "r", RANK_HEADER: "3"}
    assert header.body == body
    for field in (None, "data_parallel_rank"):
        pin = rank_pin(Runtime.SGLANG, field)
        assert pin is not None
        out = pinned(up, pin, 2)
        assert orjson.loads(out.body) == {**orjson.loads(body), field or "routed_dp_rank": 2}
        assert out.headers == up.headers
        tokenize = UpstreamRequest("/tokenize", body)
        assert pinned(tokenize, pin, 2) is tokenize  # not a generation SGLang pins
    assert rank_pin(Runtime.TRTLLM) is None
    assert rank_pin(Runtime.TRITON) is None


def test_a_clients_rank_fields_are_removed_when_parsed() -> None:
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "routed_dp_rank": 1,
                        "data_parallel_rank": 2, "disagg_prefill_dp_rank": 3, "temperature": 0.5})
    body = parse_request(raw, Endpoint.CHAT).request.body
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}


def pool(*backends: dict[str, Any]) -> Pool:
    s = settings(*backends)
    return Pool(BackendState(b, adapter_for(b.runtime)) for b in s.backends)


def test_a_wide_backend_is_one_view_per_rank_with_the_ranks_load() -> None:
    narrow = {"name": "one", "runtime": "sglang", "url": "http://127.0.0.1:2", "model": "m"}
    p = pool(WIDE, narrow)
    p["wide"].load = Load(running=8.0, waiting=4.0, per_rank=(Load(running=1.0, waiting=0.0),
                                                             Load(running=3.0, waiting=2.0)))
    p["wide"].rank_in_flight[1] = 5
    views = p.snapshot(["wide", "one"]).backends
    assert [v.name for v in views] == ["wide@0", "wide@1", "wide@2", "wide@3", "one"]
    assert [(v.backend, v.rank) for v in views] == [("wide", 0), ("wide", 1), ("wide", 2), ("wide", 3), ("one", None)]
    assert [v.in_flight for v in views] == [0, 5, 0, 0, 0]
    assert [v.waiting for v in views] == [0.0, 2.0, None, None, None]  # a rank the engine did not report: unknown
    assert unit_backend(unit_name("wide", 3)) == "wide"
    # a tried backend excludes every one of its ranks
    snap = p.snapshot(["wide", "one"])
    assert [v.name for v in snap.healthy(frozenset({"wide"}))] == ["one"]
    p["wide"].probe_ok = False
    assert [v.name for v in p.snapshot(["wide", "one"]).healthy()] == ["one"]  # health is the server's


def test_a_pool_without_ranks_builds_the_views_it_always_did() -> None:
    p = pool({**WIDE, "data_parallel_size": 1})
    [view] = p.snapshot(["wide"]).backends
    assert (view.name, view.backend, view.rank) == ("wide", "wide", None)


def test_the_engines_per_rank_load_is_read_from_their_labels() -> None:
    vllm = adapter_for(Runtime.VLLM).parse_load(b"""\
vllm:num_requests_running{engine="0",model_name="m"} 1
vllm:num_requests_running{engine="1",model_name="m"} 3
vllm:num_requests_waiting{engine="0",model_name="m"} 0
vllm:num_requests_waiting{engine="1",model_name="m"} 2
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.3
""", None)
    assert (vllm.running, vllm.waiting) == (4.0, 2.0)
    assert vllm.per_rank == (Load(running=1.0, waiting=0.0, kv_usage=0.1), Load(running=3.0, waiting=2.0, kv_usage=0.3))
    sglang = adapter_for(Runtime.SGLANG).parse_load(b"""\
sglang:num_running_reqs{dp_rank="0",tp_rank="0"} 2
sglang:num_running_reqs{dp_rank="0",tp_rank="1"} 2
sglang:num_running_reqs{dp_rank="1",tp_rank="0"} 5
sglang:num_queue_reqs{dp_rank="0",tp_rank="0"} 1
sglang:num_queue_reqs{dp_rank="1",tp_rank="0"} 0
sglang:token_usage{dp_rank="0",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="1",tp_rank="0"} 0.25
""", None)
    assert sglang.running == 7.0
    assert sglang.per_rank == (Load(running=2.0, waiting=1.0, kv_usage=0.5), Load(running=5.0, waiting=0.0,
                                                                               kv_usage=0.25))
    one = adapter_for(Runtime.VLLM).parse_load(b'vllm:num_requests_running{engine="0",model_name="m"} 1\n', None)
    assert one.per_rank == ()


def test_the_kv_index_predicts_the_rank_a_request_is_pinned_to() -> None:
    caches = KvCaches(clock=lambda: 0.0)
    cache = caches.add("wide")
    tokens = list(range(64))
    # rank 1 holds the prompt's first two blocks; rank 0 nothing
    cache.receive(Batch(0, 0.0, 1, (Stored((11, 12), None, tuple(tokens[:32]), 16),)), 0.0)
    cache.receive(Batch(0, 0.0, 0, ()), 0.0)
    assert cache.live
    prompt = TokenPrompt(tokens)
    p = pool({**WIDE, "data_parallel_size": 2})
    views = p.snapshot(["wide"]).backends
    hits = [-1, -1]
    caches.overlay(prompt, views, hits)
    assert hits == [0, 32]
    assert caches.predict("wide", prompt, 1)[0] == 32
    assert caches.predict("wide", prompt, 0)[0] == 0
    assert caches.predict("wide", prompt)[0] == 32  # unpinned: the best rank's


def test_prefix_affinity_keeps_a_prefix_on_its_rank_and_spreads_new_ones() -> None:
    """The policy knows nothing of ranks: its prefix memory is per unit, so a prefix it placed on a
    rank returns to that rank, and new prefixes spread over every rank."""
    routing = RoutingState()
    p = pool(WIDE)
    policy = POLICIES["prefix_affinity"]
    placed: dict[int, str] = {}
    for i in range(200):
        tenant = i % 20
        features = RequestFeatures(chain=(tenant * 1000 + 1, tenant * 1000 + 2, tenant * 1000 + i),
                                   prompt_bytes=192, prompt_tokens=48, affinity_key=tenant * 1000 + 1)
        snap = routing.snapshot(p.snapshot(["wide"]))
        decision = policy.choose(RouteRequest("m", i, features=features), snap, RNG)
        assert decision is not None
        view = next(v for v in snap.backends if v.name == decision.backend)
        ticket = routing.dispatched(view, features)
        routing.completed(ticket, cached_tokens=None, prompt_tokens=None, itl_s=None)
        assert placed.setdefault(tenant, decision.backend) == decision.backend
    assert set(placed.values()) == {"wide@0", "wide@1", "wide@2", "wide@3"}
    routing.retain(["wide"])  # a reload keeps what the ranks hold
    assert routing.index.size("wide@0") > 0
    routing.forget("wide", [unit_name("wide", r) for r in range(4)])
    assert routing.index.size("wide@0") == 0


def test_a_discovered_wide_server_gets_its_ranks_from_the_entry() -> None:
    entry = DiscoveryEntry.model_validate({"name": "pool", "runtime": "sglang", "model": "m", "data_parallel_size": 4,
                                           "dp_rank_field": "data_parallel_rank",
                                           "dns": {"host": "x.example", "port": 8000}})
    made = Backend.model_validate(discovered(entry, Address("10.0.0.1", 8000)).settings())
    assert (made.data_parallel_size, made.dp_rank_field) == (4, "data_parallel_rank")
    with pytest.raises(ValueError, match="data_parallel_size: trtllm-serve"):
        DiscoveryEntry.model_validate({"name": "p", "runtime": "trtllm", "model": "m", "data_parallel_size": 2,
                                       "dns": {"host": "x.example", "port": 8000}})


def test_the_supervisors_load_finding_carries_each_ranks_load_to_its_workers() -> None:
    load = Load(running=4.0, waiting=2.0, per_rank=(Load(running=1.0), Load(running=3.0, waiting=2.0)))
    back = Finding.from_wire(orjson.loads(orjson.dumps(Finding("load", "wide", 1, 1, load=load).wire())))
    assert back.load == load
