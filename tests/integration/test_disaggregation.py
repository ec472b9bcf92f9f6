"""Prefill/decode disaggregation end to end (issue 23): `gateway serve` in front of emulated vLLM
servers in prefill and decode roles, over real sockets with the official SDK.

The client sees one answer, the decode's, streamed or not; the prefill ran first (its emulator
served one request per split request); the figures count each client request once, under the
decode, with the legs and pairs in their own families.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends.emulator import DisaggConfig, RunningEmulator

from .harness import Emulators, GatewayProcess, backend_entry, eventually, wait_for

Gateway = Callable[..., GatewayProcess]
LONG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me about the sea " * 200}]
SHORT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def pd_route(backends: list[dict[str, Any]], **disaggregation: Any) -> list[dict[str, Any]]:
    return [{"model": "moe", "backends": [b["name"] for b in backends], "policy": "least_load",
             "disaggregation": disaggregation}]


def served(emu: RunningEmulator) -> int:
    return emu.ctx.stats.completed


def pair(emulators: Emulators, *, prefills: int = 1, **faults: Any) -> tuple[list[RunningEmulator], RunningEmulator,
                                                                                list[dict[str, Any]]]:
    ps = [emulators.start("vllm", **(faults if i == 0 else {})) for i in range(prefills)]
    d = emulators.start("vllm")
    backends = [backend_entry(f"p{i}", p, "vllm", role="prefill") for i, p in enumerate(ps)]
    backends.append(backend_entry("d0", d, "vllm", role="decode"))
    return ps, d, backends


@pytest.mark.parametrize("stream", [False, True])
def test_a_split_request_runs_the_prefill_then_answers_from_the_decode(emulators: Emulators, gateway: Gateway,
                                                                       stream: bool) -> None:
    (p,), d, backends = pair(emulators)
    gw = gateway(backends, routes=pd_route(backends, when="always", handoff="storage"))
    client = gw.client()
    if stream:
        chunks = list(client.chat.completions.create(model="moe", messages=LONG, max_tokens=5, stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        reply = client.chat.completions.create(model="moe", messages=LONG, max_tokens=5)
        text, usage = reply.choices[0].message.content or "", reply.usage
    assert text
    assert usage is not None
    assert usage.completion_tokens == 5  # the decode's usage, not the prefill's one token
    eventually(lambda: served(p) == 1 and served(d) == 1)
    assert p.ctx.stats.tokens_generated == 1  # leg 1 asked for one token
    assert gw.metric("gateway_requests_total", backend="d0", status="200") == 1  # counted once, as the decode's
    assert gw.metric("gateway_requests_total", backend="p0") == 0
    assert gw.metric("gateway_pd_decisions_total", decision="split", reason="always") == 1
    assert gw.metric("gateway_pd_legs_total", role="prefill", backend="p0", outcome="ok") == 1
    assert gw.metric("gateway_pd_requests_total", prefill="p0", decode="d0", outcome="ok") == 1
    assert gw.metric("gateway_pd_prefill_seconds_count", backend="p0") == 1
    if stream:
        assert gw.metric("gateway_pd_ttft_seconds_count", prefill="p0", decode="d0") == 1
        assert gw.metric("gateway_pd_transfer_seconds_count", prefill="p0", decode="d0") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_nixl_params_reach_the_decode_and_it_pulls_the_kv(emulators: Emulators, gateway: Gateway,
                                                          stream: bool) -> None:
    p = emulators.start("vllm", disagg=DisaggConfig(role="prefill"))
    d = emulators.start("vllm", disagg=DisaggConfig(role="decode"))
    backends = [backend_entry("p0", p, "vllm", role="prefill"), backend_entry("d0", d, "vllm", role="decode")]
    gw = gateway(backends, routes=pd_route(backends, when="always"))
    client = gw.client()
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="moe", messages=LONG, max_tokens=4, stream=True) if c.choices)
    else:
        text = client.chat.completions.create(model="moe", messages=LONG, max_tokens=4).choices[0].message.content or ""
    assert text
    eventually(lambda: d.ctx.stats.kv_pulled == 1)
    assert p.ctx.stats.kv_produced == 1
    assert d.ctx.stats.kv_recomputed == 0
    assert d.ctx.stats.kv_pulled_tokens > 0
    assert gw.metric("gateway_pd_legs_total", backend="p0", outcome="ok") == 1
    assert gw.metric("gateway_pd_requests_total", prefill="p0", decode="d0", outcome="ok") == 1


def test_example_connector_storage_handoff(emulators: Emulators, gateway: Gateway, tmp_path: Path) -> None:
    shared = DisaggConfig(connector="ExampleConnector", shared_storage_path=str(tmp_path))
    p = emulators.start("vllm", disagg=dataclasses.replace(shared, role="prefill"))
    d = emulators.start("vllm", disagg=dataclasses.replace(shared, role="decode"))
    backends = [backend_entry("p0", p, "vllm", role="prefill"), backend_entry("d0", d, "vllm", role="decode")]
    gw = gateway(backends, routes=pd_route(backends, when="always", handoff="storage"))
    assert gw.client().chat.completions.create(model="moe", messages=LONG, max_tokens=3).choices[0].message.content
    eventually(lambda: served(d) == 1)
    assert gw.metric("gateway_pd_legs_total", backend="p0", outcome="ok") == 1  # null params expected
    assert gw.metric("gateway_pd_requests_total", prefill="p0", decode="d0", outcome="ok") == 1


def test_a_prefill_without_params_is_a_failed_handoff_in_the_figures(emulators: Emulators, gateway: Gateway) -> None:
    """The emulated prefill (without a KV connector's params) answers `kv_transfer_params: null`:
    with `handoff: params` the decode recomputes, the client is served, the pair counts it failed."""
    (p,), d, backends = pair(emulators)
    gw = gateway(backends, routes=pd_route(backends, when="always"))
    reply = gw.client().chat.completions.create(model="moe", messages=LONG, max_tokens=3)
    assert reply.choices[0].message.content
    eventually(lambda: served(p) == 1 and served(d) == 1)
    assert gw.metric("gateway_pd_legs_total", backend="p0", outcome="no_params") == 1
    assert gw.metric("gateway_pd_requests_total", prefill="p0", decode="d0", outcome="handoff_failed") == 1


def test_auto_splits_long_prompts_and_keeps_short_ones_whole(emulators: Emulators, gateway: Gateway) -> None:
    (p,), d, backends = pair(emulators)
    gw = gateway(backends, routes=pd_route(backends, when="auto", min_uncached_tokens=256, handoff="storage"))
    client = gw.client()
    client.chat.completions.create(model="moe", messages=SHORT, max_tokens=2)
    assert served(p) == 0
    eventually(lambda: served(d) == 1)
    client.chat.completions.create(model="moe", messages=LONG, max_tokens=2)
    eventually(lambda: served(p) == 1 and served(d) == 2)
    assert gw.metric("gateway_pd_decisions_total", decision="whole", reason="cached") == 1
    assert gw.metric("gateway_pd_decisions_total", decision="split", reason="uncached") == 1


def test_a_failed_prefill_is_retried_on_another_and_never_ejects_the_decode(emulators: Emulators,
                                                                             gateway: Gateway) -> None:
    (bad, good), d, backends = pair(emulators, prefills=2, fail_first=100, fail_status=500)
    gw = gateway(backends, routes=pd_route(backends, when="always", handoff="storage"))
    client = gw.client()
    for _ in range(4):
        assert client.chat.completions.create(model="moe", messages=LONG, max_tokens=2).choices[0].message.content
    assert served(good) >= 3
    assert bad.ctx.stats.failed_injected >= 1  # tried first at least once, then never again once ejected
    assert served(d) == 4
    assert gw.metric("gateway_requests_total", backend="d0", status="200") == 4
    assert gw.metric("gateway_pd_legs_total", backend="p0", outcome="BackendProtocolError") >= 1
    assert gw.metric("gateway_backend_ejections_total", backend="p0") >= 1  # judged: two failures eject it
    assert gw.metric("gateway_backend_ejections_total", backend="d0") == 0


@pytest.mark.parametrize("status", [503, 429])
def test_a_decode_that_refuses_the_leg_is_replaced_by_another_decode(emulators: Emulators, gateway: Gateway,
                                                                     status: int) -> None:
    """A refusal (the engine did no work) of the planned decode: the leg goes to another decode of
    the pool with the same handoff, which pulls the prefill's KV; the prefill ran once, the request
    is counted once, as the second decode's."""
    p = emulators.start("vllm", disagg=DisaggConfig(role="prefill"))
    refusing = emulators.start("vllm", disagg=DisaggConfig(role="decode"), fail_first=1, fail_status=status)
    other = emulators.start("vllm", disagg=DisaggConfig(role="decode"))
    backends = [backend_entry("p0", p, "vllm", role="prefill"), backend_entry("d0", refusing, "vllm", role="decode"),
                backend_entry("d1", other, "vllm", role="decode")]
    gw = gateway(backends, routes=pd_route(backends, when="always"))
    raw = gw.client().chat.completions.with_raw_response.create(model="moe", messages=LONG, max_tokens=3)
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-gateway-backend"] == "d1"
    assert refusing.ctx.stats.failed_injected == 1  # planned first (config order among idle decodes)
    eventually(lambda: other.ctx.stats.kv_pulled == 1)
    assert p.ctx.stats.kv_produced == 1
    assert served(p) == 1
    assert other.ctx.stats.kv_recomputed == 0
    assert gw.metric("gateway_requests_total", backend="d1", status="200") == 1
    assert gw.metric("gateway_requests_total", backend="d0") == 0
    assert gw.metric("gateway_retries_total", backend="d0") == 1
    assert gw.metric("gateway_pd_requests_total", prefill="p0", decode="d1", outcome="ok") == 1


def test_with_no_prefill_left_the_decode_serves_alone(emulators: Emulators, gateway: Gateway) -> None:
    (bad,), d, backends = pair(emulators, fail_first=100, fail_status=500)
    gw = gateway(backends, routes=pd_route(backends, when="always", handoff="storage"))
    reply = gw.client().chat.completions.create(model="moe", messages=LONG, max_tokens=2)
    assert reply.choices[0].message.content
    assert bad.ctx.stats.failed_injected == 1  # one prefill leg, no other prefill to retry on
    assert served(d) == 1
    assert gw.metric("gateway_pd_requests_total", prefill="none", decode="d0", outcome="prefill_failed") == 1
    assert gw.metric("gateway_requests_total", backend="d0", status="200") == 1


def test_the_comparison_shows_pairs_their_legs_and_the_topologies(emulators: Emulators, gateway: Gateway) -> None:
    (p,), d, backends = pair(emulators)
    gw = gateway(backends, routes=pd_route(backends, when="auto", min_uncached_tokens=256, handoff="storage"))
    client = gw.client()
    other: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me about the sky " * 200}]
    for messages in (LONG, other, SHORT, LONG):  # the last is cached on the decode by now: kept whole
        list(client.chat.completions.create(model="moe", messages=messages, max_tokens=3, stream=True))

    def document() -> dict[str, Any]:
        doc: dict[str, Any] = gw.get("/admin/compare?window=60").json()
        return doc

    doc = wait_for(document, lambda doc: sum(r["requests"] for r in doc["topologies"]) == 4, what="topology rows")
    topologies = {r["name"]: r for r in doc["topologies"]}
    assert (topologies["split"]["requests"], topologies["whole"]["requests"]) == (2, 2)
    assert topologies["split"]["ttft_s"]["n"] == 2
    [row] = doc["pairs"]
    assert (row["route"], row["prefill"], row["decode"], row["requests"]) == ("moe", "p0", "d0", 2)
    assert row["prefill_s"]["n"] == 2
    assert row["transfer_s"]["n"] == 2
    assert row["ttft_s"]["p50"] >= row["prefill_s"]["p50"]  # the true TTFT includes the prefill leg
    assert served(p) == 2
    assert served(d) == 4


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_sends_both_legs_at_once_and_answers_from_the_decode(emulators: Emulators, gateway: Gateway,
                                                                    stream: bool) -> None:
    p = emulators.start("sglang", data_parallel_size=2, disagg=DisaggConfig(role="prefill", bootstrap_port=0))
    d = emulators.start("sglang", disagg=DisaggConfig(role="decode"))
    assert p.bootstrap_port is not None
    backends = [backend_entry("sp", p, "sglang", role="prefill", bootstrap_port=p.bootstrap_port,
                              data_parallel_size=2),
                backend_entry("sd", d, "sglang", role="decode")]
    gw = gateway(backends, routes=pd_route(backends, when="always"))
    client = gw.client()
    if stream:
        chunks = list(client.chat.completions.create(model="moe", messages=LONG, max_tokens=4, stream=True,
                                                     stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    else:
        usage = client.chat.completions.create(model="moe", messages=LONG, max_tokens=4).usage
    assert usage is not None
    assert usage.completion_tokens == 4
    eventually(lambda: served(p) == 1 and served(d) == 1)
    assert gw.metric("gateway_requests_total", backend="sd", status="200") == 1  # once, as the decode's
    assert gw.metric("gateway_requests_total", backend="sp") == 0
    assert gw.metric("gateway_pd_legs_total", role="prefill", backend="sp", outcome="ok") == 1
    assert gw.metric("gateway_pd_requests_total", prefill="sp", decode="sd", outcome="ok") == 1
    assert sum(p.served_by_rank()) == 1  # one rank of the wide prefill served its leg, where the room said
    assert p.ctx.stats.kv_produced == 1
    assert d.ctx.stats.kv_pulled == 1  # the rendezvous met: the decode computed no prefill of its own
    assert d.ctx.stats.pd_failed == 0


def test_the_decode_leg_goes_to_the_rank_its_pair_was_planned_with(emulators: Emulators, gateway: Gateway) -> None:
    """A wide decode server (3 DP ranks) one of whose ranks carries a long stream (of another
    route): the plan picks an idle rank by decode load for every split request, and each decode leg
    goes there, never where the route's own policy (round robin over the ranks) would send it."""
    p = emulators.start("vllm", disagg=DisaggConfig(role="prefill"))
    wide = emulators.start("vllm", data_parallel_size=3, speed=2.0, disagg=DisaggConfig(role="decode"))
    backends = [backend_entry("p0", p, "vllm", role="prefill"),
                backend_entry("wide", wide, "vllm", role="decode", data_parallel_size=3)]
    routes = [{"model": "moe", "backends": ["p0", "wide"], "policy": "round_robin",
               "disaggregation": {"when": "always"}},
              {"model": "plain", "backends": ["wide"], "policy": "least_load"}]
    gw = gateway(backends, routes=routes)
    opened = threading.Event()
    busy: list[str] = []

    def long_stream() -> None:
        try:
            with gw.client().chat.completions.with_streaming_response.create(
                    model="plain", messages=SHORT, max_tokens=400, stream=True) as resp:
                busy.append(resp.headers["x-gateway-data-parallel-rank"])
                opened.set()
                for _ in resp.iter_lines():
                    pass
        finally:
            opened.set()

    holder = threading.Thread(target=long_stream, daemon=True)
    holder.start()
    assert opened.wait(20)
    [loaded] = busy
    eventually(lambda: gw.metric("gateway_rank_in_flight", backend="wide", rank=loaded) == 1)
    client = gw.client()
    ranks = [int(client.chat.completions.with_raw_response.create(model="moe", messages=LONG, max_tokens=2)
                 .headers["x-gateway-data-parallel-rank"]) for _ in range(6)]
    assert int(loaded) not in ranks, ranks  # round robin over 3 ranks would have sent 2 of 6 there
    assert wide.served_by_rank()[int(loaded)] == 1  # the stream alone
    assert sum(wide.served_by_rank()) == 7
    assert gw.metric("gateway_pd_requests_total", prefill="p0", outcome="ok") == 6
    holder.join(60)


def sglang_fleet(emulators: Emulators, *, prefills: int, both: bool = False) -> tuple[
        list[RunningEmulator], RunningEmulator, list[RunningEmulator], list[dict[str, Any]]]:
    """SGLang prefills (the first fails its first leg with a 500), one decode (SGLang's default
    300 s waiting timeout for the KV), and maybe a server in null mode (role both)."""
    ps = [emulators.start("sglang", disagg=DisaggConfig(role="prefill", bootstrap_port=0),
                          fail_first=1 if i == 0 else 0, fail_status=500) for i in range(prefills)]
    d = emulators.start("sglang", disagg=DisaggConfig(role="decode"))
    backends = [backend_entry(f"sp{i}", p, "sglang", role="prefill", bootstrap_port=p.bootstrap_port)
                for i, p in enumerate(ps)]
    backends.append(backend_entry("sd", d, "sglang", role="decode"))
    whole = [emulators.start("sglang")] if both else []
    backends += [backend_entry("sb", w, "sglang") for w in whole]
    return ps, d, whole, backends


def test_a_failed_sglang_prefill_is_retried_in_a_new_room_without_waiting_for_the_decode(
        emulators: Emulators, gateway: Gateway) -> None:
    """SGLang's decode waits for the KV of its room (300 s by default): when the prefill fails
    first, the gateway abandons the decode leg (it computed nothing) and runs the pair again with
    the other prefill, in a new room; the client never waits for SGLang's timeout (the SDK's 20 s
    would fail this)."""
    (bad, good), d, _, backends = sglang_fleet(emulators, prefills=2)
    gw = gateway(backends, routes=pd_route(backends, when="always"))
    client = gw.client().with_options(timeout=20, max_retries=0)
    sent = 0
    while bad.ctx.stats.failed_injected == 0:  # new prefixes, until prefix affinity picks the bad one (1/2 each)
        assert sent < 16
        prompt = f"conversation {sent}: " + "tell me about the sea " * 200
        usage = client.chat.completions.create(model="moe", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=3).usage
        assert usage is not None
        assert usage.completion_tokens == 3
        sent += 1
    eventually(lambda: good.ctx.stats.kv_produced + bad.ctx.stats.kv_produced == sent
               and d.ctx.stats.kv_pulled == sent)
    assert served(d) == sent  # the abandoned leg never completed: the decode served each request once
    assert bad.ctx.stats.failed_injected == 1
    assert gw.metric("gateway_pd_legs_total", role="prefill", backend="sp0", outcome="BackendProtocolError") == 1
    assert gw.metric("gateway_pd_requests_total", prefill="sp1", decode="sd", outcome="ok") >= 1
    assert gw.metric("gateway_pd_requests_total", outcome="ok") == sent
    assert gw.metric("gateway_requests_total", backend="sd", status="200") == sent
    assert gw.metric("gateway_backend_ejections_total", backend="sd") == 0


def test_with_no_sglang_prefill_left_a_both_server_serves_it_whole(emulators: Emulators, gateway: Gateway) -> None:
    (bad,), d, (whole,), backends = sglang_fleet(emulators, prefills=1, both=True)
    gw = gateway(backends, routes=pd_route(backends, when="always"))
    raw = gw.client().with_options(timeout=20, max_retries=0).chat.completions.with_raw_response.create(
        model="moe", messages=LONG, max_tokens=2)
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-gateway-backend"] == "sb"
    assert bad.ctx.stats.failed_injected == 1
    assert served(whole) == 1
    assert served(d) == 0
    assert gw.metric("gateway_pd_requests_total", prefill="none", decode="sb", outcome="prefill_failed") == 1


def test_with_no_sglang_prefill_left_and_no_both_server_the_client_gets_a_502_at_once(
        emulators: Emulators, gateway: Gateway) -> None:
    (bad,), d, _, backends = sglang_fleet(emulators, prefills=1)
    gw = gateway(backends, routes=pd_route(backends, when="always"))
    with pytest.raises(openai.InternalServerError) as failed:
        gw.client().with_options(timeout=20, max_retries=0).chat.completions.create(
            model="moe", messages=LONG, max_tokens=2)
    assert failed.value.status_code == 502
    assert "sp0" in failed.value.message
    assert "without one" in failed.value.message
    assert bad.ctx.stats.failed_injected == 1
    assert served(d) == 0
    assert gw.metric("gateway_requests_total", backend="sd", status="200") == 0


def test_trtllm_context_then_generation(emulators: Emulators, gateway: Gateway) -> None:
    c = emulators.start("trtllm", disagg=DisaggConfig(role="prefill"))
    g = emulators.start("trtllm", disagg=DisaggConfig(role="decode"))
    backends = [backend_entry("ctx", c, "trtllm", role="prefill"), backend_entry("gen", g, "trtllm", role="decode")]
    gw = gateway(backends, routes=pd_route(backends, when="always"))
    reply = gw.client().chat.completions.create(model="moe", messages=LONG, max_tokens=4)
    assert reply.choices[0].message.content
    eventually(lambda: served(c) == 1 and served(g) == 1)
    assert gw.metric("gateway_requests_total", backend="gen", status="200") == 1
    assert gw.metric("gateway_pd_legs_total", role="prefill", backend="ctx", outcome="ok") == 1
    assert gw.metric("gateway_pd_requests_total", prefill="ctx", decode="gen", outcome="ok") == 1
    assert c.ctx.stats.kv_produced == 1
    assert g.ctx.stats.kv_pulled == 1


def test_ab_arms_as_topologies_compare_aggregated_with_pd(emulators: Emulators, gateway: Gateway) -> None:
    """A split route whose arms are an aggregated pool and a P/D pool of one model: each session
    sticks to its arm, the P/D arm's requests are split, and the comparison has both arms."""
    a0, a1 = emulators.start("vllm"), emulators.start("vllm")
    p = emulators.start("vllm", disagg=DisaggConfig(role="prefill"))
    d = emulators.start("vllm", disagg=DisaggConfig(role="decode"))
    backends = [backend_entry("a0", a0, "vllm"), backend_entry("a1", a1, "vllm"),
                backend_entry("p0", p, "vllm", role="prefill"), backend_entry("d0", d, "vllm", role="decode")]
    arms = [{"name": "aggregated", "weight": 1, "backends": ["a0", "a1"], "disaggregation": {"when": "never"}},
            {"name": "pd", "weight": 1, "backends": ["p0", "d0"], "disaggregation": {"when": "always"}}]
    gw = gateway(backends, routes=[{"model": "moe", "policy": "least_load", "split": {"arms": arms}}])
    client = gw.client()
    for i in range(12):
        assert client.chat.completions.create(model="moe", messages=LONG, max_tokens=2,
                                              user=f"session-{i}").choices[0].message.content
    split = gw.metric("gateway_pd_decisions_total", decision="split")
    whole = gw.metric("gateway_pd_decisions_total", decision="whole", reason="never")
    assert split + whole == 12
    assert split >= 1  # both arms got sessions
    assert whole >= 1
    assert served(p) == split
    assert served(d) == split
    assert served(a0) + served(a1) == whole

    def document() -> dict[str, Any]:
        doc: dict[str, Any] = gw.get("/admin/compare?window=60").json()
        return doc

    doc = wait_for(document, lambda doc: sum(r["requests"] for r in doc["arms"]) == 12, what="the arms' rows")
    assert {r["name"]: r["requests"] for r in doc["arms"]} == {"aggregated": whole, "pd": split}
    assert {r["name"]: r["requests"] for r in doc["topologies"]} == {"split": split, "whole": whole}
    [ab] = doc["ab"]
    assert ab["route"] == "moe"


def test_pair_figures_cover_every_worker(emulators: Emulators, gateway: Gateway) -> None:
    """Under `--workers 2` the merged /metrics and /admin/compare count every worker's pairs."""
    p = emulators.start("vllm", disagg=DisaggConfig(role="prefill"))
    d = emulators.start("vllm", disagg=DisaggConfig(role="decode"))
    backends = [backend_entry("p0", p, "vllm", role="prefill"), backend_entry("d0", d, "vllm", role="decode")]
    gw = gateway(backends, routes=pd_route(backends, when="always"), workers=2)
    eventually(lambda: gw.get("/ready").status_code == 200)
    for i in range(6):
        client = gw.client()  # a new connection each: SO_REUSEPORT spreads them over the workers
        text: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"story {i} " * 300}]
        list(client.chat.completions.create(model="moe", messages=text, max_tokens=2, stream=True))
    eventually(lambda: gw.metric("gateway_pd_requests_total", prefill="p0", decode="d0", outcome="ok") == 6)

    def document() -> dict[str, Any]:
        doc: dict[str, Any] = gw.get("/admin/compare?window=60").json()
        return doc

    doc = wait_for(document, lambda doc: sum(r["requests"] for r in doc["pairs"]) == 6, what="the merged pair row")
    [row] = doc["pairs"]
    assert row["prefill_s"]["n"] == 6
    assert row["transfer_s"]["n"] == 6
    assert d.ctx.stats.kv_pulled == 6
