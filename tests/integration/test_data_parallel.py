"""Data-parallel ranks end to end (issue 23): `gateway serve` in front of emulated vLLM and SGLang
servers of several DP engines, over real sockets with the official SDK.

A backend with `data_parallel_size: N` is N routing units: every request is pinned to one rank
(vLLM: `X-data-parallel-rank`; SGLang: `routed_dp_rank`, or `data_parallel_rank` by config), the
emulator says which engine served it (`RunningEmulator.served_by_rank`, `x-emulator-...`), prefix
memory and the KV-event index are per rank, load steers per rank, a client's own rank never
reaches an engine, and a backend of one rank is never pinned.
"""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends.emulator import KvEventsConfig, RunningEmulator
from backends.emulator.kv_zmq import ZmqKvPublisher

from .harness import Emulators, GatewayProcess, backend_entry, eventually, wait_for

Gateway = Callable[..., GatewayProcess]
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


def two_free_ports() -> int:
    """A port P such that P and P + 1 are free on 127.0.0.1 (rank r publishes on P + r)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


def route(backends: list[dict[str, Any]], policy: str, **extra: Any) -> list[dict[str, Any]]:
    return [{"model": "moe", "backends": [b["name"] for b in backends], "policy": policy, **extra}]


def rank_of(raw: Any) -> int:
    return int(raw.headers["x-gateway-data-parallel-rank"])


@pytest.mark.parametrize(("runtime", "field"), [("vllm", None), ("sglang", None), ("sglang", "data_parallel_rank")])
def test_requests_are_pinned_to_every_rank(emulators: Emulators, gateway: Gateway, runtime: str,
                                           field: str | None) -> None:
    emu = emulators.start(runtime, data_parallel_size=2)
    extra = {"data_parallel_size": 2} | ({"dp_rank_field": field} if field else {})
    backends = [backend_entry("wide", emu, runtime, **extra)]
    gw = gateway(backends, routes=route(backends, "round_robin"))
    client = gw.client()
    ranks = [rank_of(client.chat.completions.with_raw_response.create(model="moe", messages=HI, max_tokens=2))
             for _ in range(6)]
    assert sorted(ranks) == [0, 0, 0, 1, 1, 1]
    assert emu.served_by_rank() == [3, 3]  # the engines served what the gateway pinned
    assert emu.ctx.pinned_requests == 6  # ... because every request named its rank
    for rank in (0, 1):
        assert gw.metric("gateway_rank_responses_total", backend="wide", rank=str(rank), status="200") == 3
    assert gw.metric("gateway_requests_total", backend="wide", status="200") == 6  # the server as a whole


@pytest.mark.parametrize("runtime", ["vllm", "sglang"])
def test_a_client_rank_is_stripped_and_one_rank_is_never_pinned(emulators: Emulators, gateway: Gateway,
                                                                 runtime: str) -> None:
    """The server has two engines but the config says one: the gateway pins nothing, and the
    client's own header and body fields (all of which the engines would honour) never arrive."""
    emu = emulators.start(runtime, data_parallel_size=2)
    backends = [backend_entry("narrow", emu, runtime)]
    gw = gateway(backends)
    client = gw.client()
    for _ in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model="moe", messages=HI, max_tokens=2, extra_headers={"X-data-parallel-rank": "1"},
            extra_body={"routed_dp_rank": 1, "data_parallel_rank": 1, "disagg_prefill_dp_rank": 1})
        assert "x-gateway-data-parallel-rank" not in raw.headers
    assert emu.ctx.pinned_requests == 0
    # the engine's own balancer placed them: vLLM's least-loaded (all idle: engine 0), SGLang's round robin
    assert emu.served_by_rank() == ([4, 0] if runtime == "vllm" else [2, 2])


def test_load_steers_per_rank(emulators: Emulators, gateway: Gateway) -> None:
    """A long stream open on one rank: least_load sends what follows to the other rank."""
    emu = emulators.start("vllm", data_parallel_size=2, speed=2.0)
    backends = [backend_entry("wide", emu, "vllm", data_parallel_size=2)]
    gw = gateway(backends, routes=route(backends, "least_load"))
    client = gw.client()
    opened = threading.Event()
    busy: list[int] = []

    def long_stream() -> None:
        with client.chat.completions.with_streaming_response.create(
                model="moe", messages=HI, max_tokens=400, stream=True) as resp:
            busy.append(rank_of(resp))
            opened.set()
            for _ in resp.iter_lines():
                pass

    worker = threading.Thread(target=long_stream, daemon=True)
    worker.start()
    assert opened.wait(20)
    eventually(lambda: gw.metric("gateway_rank_in_flight", backend="wide", rank=str(busy[0])) == 1)
    others = [rank_of(client.chat.completions.with_raw_response.create(model="moe", messages=HI, max_tokens=1))
              for _ in range(5)]
    assert others == [1 - busy[0]] * 5
    worker.join(60)


def conversations(n: int) -> list[list[ChatCompletionMessageParam]]:
    """`n` requests of 4 tenants, each tenant's prompts sharing a long system prompt."""
    systems = [f"Tenant {t} runs a shop. " + " ".join(f"rule {t}-{i} applies." for i in range(40)) for t in range(4)]
    return [[{"role": "system", "content": systems[i % 4]}, {"role": "user", "content": f"question {i}"}]
            for i in range(n)]


def subscribed(emu: RunningEmulator) -> None:
    for rank in emu.ctx.ranks:
        pub = rank.kv_publisher
        assert isinstance(pub, ZmqKvPublisher)
        wait_for(functools.partial(getattr, pub, "subscriptions"), lambda n: n > 0, what="the gateway's subscription")


def test_prefix_affinity_per_rank_on_the_ranks_kv_events(emulators: Emulators, gateway: Gateway) -> None:
    """Each rank publishes on port + rank; the gateway keeps an index per rank, predicts each
    request's cached tokens on the rank it pins to exactly, and keeps a tenant on its rank."""
    port = two_free_ports()
    emu = emulators.start("vllm", data_parallel_size=2, block_size=16, num_kv_blocks=64,
                          kv_events=KvEventsConfig(endpoint=f"tcp://127.0.0.1:{port}"))
    backends = [backend_entry("wide", emu, "vllm", data_parallel_size=2,
                              kv_events={"endpoint": f"tcp://127.0.0.1:{port}", "bind": True})]
    gw = gateway(backends, routes=route(backends, "prefix_affinity", tokenizer="emulator"))
    subscribed(emu)
    client = gw.client()
    placed: dict[int, set[int]] = {}
    compared = 0
    for i, messages in enumerate(conversations(24)):
        raw = client.chat.completions.with_raw_response.create(model="moe", messages=messages, max_tokens=2)
        reply = raw.parse()
        assert reply.usage is not None
        assert reply.usage.prompt_tokens_details is not None
        reported = reply.usage.prompt_tokens_details.cached_tokens or 0
        placed.setdefault(i % 4, set()).add(rank_of(raw))
        state = gw.get("/admin/backends").json()["backends"][0]["kv_events"]
        if i >= 4 and state["state"] == "live":  # each tenant's first request has nothing cached anywhere
            compared += 1
            assert int(raw.headers["x-gateway-expected-cached-tokens"]) == reported > 0
    assert compared >= 16
    assert all(len(ranks) == 1 for ranks in placed.values()), placed  # a tenant stays on its rank
    assert {r for ranks in placed.values() for r in ranks} == {0, 1}  # and the tenants use both
    ranks = gw.get("/admin/backends").json()["backends"][0]["kv_events"]["ranks"]
    assert set(ranks) == {"0", "1"}
    assert all(r["blocks"] > 0 for r in ranks.values())


def test_the_comparison_shows_the_ranks_and_the_server(emulators: Emulators, gateway: Gateway) -> None:
    emu = emulators.start("sglang", data_parallel_size=2)
    backends = [backend_entry("wide", emu, "sglang", data_parallel_size=2)]
    gw = gateway(backends, routes=route(backends, "round_robin"))
    client = gw.client()
    for _ in range(4):
        client.chat.completions.create(model="moe", messages=HI, max_tokens=2)

    def document() -> dict[str, Any]:
        doc: dict[str, Any] = gw.get("/admin/compare?window=60").json()
        return doc

    doc = wait_for(document, lambda d: sum(r["requests"] for r in d["ranks"]) == 4, what="the rank rows")
    rows = {(r["backend"], r["rank"]): r for r in doc["ranks"]}
    assert rows.keys() == {("wide", 0), ("wide", 1)}
    assert [rows[("wide", r)]["requests"] for r in (0, 1)] == [2, 2]
    [server] = [b for b in doc["backends"] if b["name"] == "wide"]
    assert server["requests"] == 4  # the server as a whole
    eventually(lambda: gw.metric("gateway_rank_engine_running", backend="wide", rank="1") == 0
               and "gateway_rank_engine_running" in gw.get("/metrics").text)


def test_per_rank_figures_merge_over_workers(emulators: Emulators, gateway: Gateway) -> None:
    """Under `--workers 2` the supervisor's /metrics adds the workers' per-rank counts (merge rule
    `sum`), and they equal what each engine served."""
    emu = emulators.start("vllm", data_parallel_size=2)
    backends = [backend_entry("wide", emu, "vllm", data_parallel_size=2)]
    gw = gateway(backends, routes=route(backends, "round_robin"), workers=2)
    client = gw.client()
    for _ in range(8):
        client.chat.completions.create(model="moe", messages=HI, max_tokens=2)
    served = emu.served_by_rank()
    assert sum(served) == 8
    assert emu.ctx.pinned_requests == 8
    eventually(lambda: [gw.metric("gateway_rank_responses_total", backend="wide", rank=str(r)) for r in (0, 1)]
               == [float(n) for n in served])
