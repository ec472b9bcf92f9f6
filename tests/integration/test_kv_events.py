"""The gateway on the engines' own KV events, against emulators publishing them as the runtimes do
(vLLM in both encodings, SGLang, trtllm-serve): with `tokenizer: emulator`, every response's
`x-gateway-expected-cached-tokens` is the `cached_tokens` the engine reports while events are live;
lost, silent or restarted publishers fall back to the approximate index and recover."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends.emulator import KvEventsConfig, RunningEmulator
from backends.emulator.config import KvEncoding
from backends.emulator.kv_zmq import ZmqKvPublisher

from .harness import Emulators, GatewayProcess, LoopThread, backend_entry, wait_for

Gateway = Callable[..., GatewayProcess]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def conversations(seed: int, n: int) -> list[list[ChatCompletionMessageParam]]:
    """`n` requests: 4 tenants' system prompts, conversations of up to 4 turns resending history."""
    rng = random.Random(seed)
    systems = [f"Tenant {t} instructions. " + " ".join(f"w{rng.randrange(999)}" for _ in range(90)) for t in range(4)]
    live: list[list[ChatCompletionMessageParam]] = []
    out: list[list[ChatCompletionMessageParam]] = []
    for i in range(n):
        if not live or rng.random() < 0.3 or len(live[-1]) > 8:
            live.append([{"role": "system", "content": systems[rng.randrange(4)]}])
        history = live[rng.randrange(len(live))]
        if len(history) > 8:
            history = live[-1]
        history.append({"role": "user", "content": f"question {i}: " + "x" * rng.randrange(40)})
        out.append(list(history))
        history.append({"role": "assistant", "content": f"answer {i}"})
    return out


def kv_state(gw: GatewayProcess, name: str) -> dict[str, Any]:
    [backend] = [b for b in gw.get("/admin/backends").json()["backends"] if b["name"] == name]
    state: dict[str, Any] = backend["kv_events"]
    return state


def ask(client: openai.OpenAI, messages: list[ChatCompletionMessageParam], model: str = "moe") -> tuple[int, int, str]:
    """(expected, reported cached tokens, backend) of one request."""
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=2)
    reply = raw.parse()
    assert reply.usage is not None
    details = reply.usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens is not None
    return int(raw.headers["x-gateway-expected-cached-tokens"]), details.cached_tokens, raw.headers["x-gateway-backend"]


def publishing(emulators: Emulators, runtime: str, *, encoding: KvEncoding = "map", block_size: int = 16,
               blocks: int = 48, **kv: Any) -> tuple[RunningEmulator, dict[str, Any]]:
    """An emulator publishing events, and its backend entry (the gateway binds, the engine connects)."""
    if runtime == "trtllm":
        emu = emulators.start(runtime, kv_events=KvEventsConfig(), block_size=block_size, num_kv_blocks=blocks)
        return emu, {"kv_events": {}}
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gw_kv = {"endpoint": endpoint, "bind": True, **{k: v for k, v in kv.items() if k in ("replay_endpoint",
                                                                                          "silent_after_s")}}
    emu_kv = {k: v for k, v in kv.items() if k != "silent_after_s"}
    emu = emulators.start(runtime, kv_events=KvEventsConfig(endpoint=endpoint, encoding=encoding, **emu_kv),
                          block_size=block_size, num_kv_blocks=blocks)
    return emu, {"kv_events": gw_kv}


def start_gateway(gateway: Gateway, backends: list[dict[str, Any]], *engines: RunningEmulator) -> GatewayProcess:
    """The gateway, once each of `engines` (publishers the gateway binds for) hears its subscription."""
    gw = gateway(backends, routes=[{"model": "moe", "backends": [b["name"] for b in backends],
                                    "policy": "prefix_affinity", "tokenizer": "emulator"}])
    for emu in engines:
        subscribed(emu)
    return gw


def subscribed(emu: RunningEmulator) -> None:
    """Wait until `emu`'s publisher has the gateway's subscription: batches published before are
    dropped (ZMQ's slow joiner), and the gateway would join late and rebuild, as against a real
    engine; the tests below want the first batch (`test_a_late_joiner_...` joins late on purpose)."""
    if isinstance(emu.kv_events, ZmqKvPublisher):
        wait_for(lambda: zmq_publisher(emu).subscriptions, lambda n: n > 0, what="the gateway's subscription")


@pytest.mark.parametrize(("runtime", "encoding", "block_size"), [
    ("vllm", "map", 16), ("vllm", "array", 16), ("sglang", "map", 4), ("trtllm", "map", 32),
])
def test_expected_cached_tokens_equal_the_engines_while_events_are_live(
    emulators: Emulators, gateway: Gateway, runtime: str, encoding: KvEncoding, block_size: int,
) -> None:
    fleet = [publishing(emulators, runtime, encoding=encoding, block_size=block_size, blocks=768 // block_size)
             for _ in range(2)]
    backends = [backend_entry(f"{runtime}-{i}", emu, runtime, **extra) for i, (emu, extra) in enumerate(fleet)]
    gw = start_gateway(gateway, backends, *(emu for emu, _ in fleet))
    client = gw.client()
    names = [b["name"] for b in backends]
    compared = exact = 0
    for messages in conversations(seed=len(runtime), n=40):
        live = {n for n in names if kv_state(gw, n)["state"] == "live"}
        expected, reported, served_by = ask(client, messages)
        if served_by in live:
            compared += 1
            exact += expected == reported
            assert expected == reported, (messages, expected, reported)
    assert compared >= 30
    states = [kv_state(gw, n) for n in names]
    assert all(s["state"] in ("live", "waiting") and s["resets"].keys() <= {"cleared"} for s in states), states
    held = [s["ranks"]["0"] for s in states if s["state"] == "live"]
    assert held
    assert all(0 < r["blocks"] <= 768 // block_size and r["block_size"] == block_size for r in held)  # full: evicting
    assert sum(s["predictions_checked"] for s in states) == sum(s["predictions_exact"] for s in states) >= compared
    # evictions happened (the caches are small), and the histogram saw only exact predictions
    error = "gateway_prefix_prediction_error_tokens"
    assert gw.metric(f"{error}_count", source="exact") >= compared
    assert gw.metric(f"{error}_bucket", source="exact", le="0.0") == gw.metric(f"{error}_count", source="exact")
    assert gw.metric("gateway_kv_events_live") == sum(s["state"] == "live" for s in states) >= 1
    assert gw.metric("gateway_kv_index_blocks") > 0


def zmq_publisher(emu: RunningEmulator) -> ZmqKvPublisher:
    pub = emu.kv_events
    assert isinstance(pub, ZmqKvPublisher)
    return pub


def test_a_gap_falls_back_then_rebuilds_and_is_verified(emulators: Emulators, gateway: Gateway,
                                                         loop_thread: LoopThread) -> None:
    emu, extra = publishing(emulators, "vllm")
    gw = start_gateway(gateway, [backend_entry("v", emu, "vllm", **extra)], emu)
    client = gw.client()
    requests = conversations(seed=3, n=40)
    for messages in requests[:4]:
        ask(client, messages)
    wait_for(lambda: kv_state(gw, "v")["state"], lambda st: st == "live", what="a live index")  # events lag answers
    loop_thread.loop.call_soon_threadsafe(zmq_publisher(emu).drop_next)
    i = 4
    while kv_state(gw, "v")["state"] == "live":  # the gap shows with the next batch after the dropped one
        ask(client, requests[i])
        i += 1
        assert i < 12
    state = kv_state(gw, "v")
    assert (state["state"], state["reason"], state["resets"]) == ("rebuilding", "gap", {"gap": 1})
    # Rebuilt from the next events, then verified by answers whose cached tokens were predicted
    # right: keep asking (cycling through the conversations) until it is live, within a deadline
    # (events reach the gateway asynchronously, later on a loaded machine).
    deadline = time.monotonic() + 60
    rest = requests[i:] + requests
    while kv_state(gw, "v")["state"] != "live":
        assert time.monotonic() < deadline, kv_state(gw, "v")
        ask(client, rest[i % len(rest)])
        i += 1
    state = kv_state(gw, "v")
    assert (state["state"], state["reason"]) == ("live", "rebuilt: predictions verified")
    expected, reported, _ = ask(client, requests[-1])
    assert expected == reported
    assert gw.metric("gateway_kv_index_resets_total", reason="gap") == 1


def test_a_late_joiner_rebuilds_and_is_verified(emulators: Emulators, gateway: Gateway) -> None:
    """The engine's first batch never reaches the gateway (as when the engine served before the
    gateway subscribed): it joins late, routes on the approximate index, and trusts the events
    once answers confirm them."""
    emu, extra = publishing(emulators, "vllm", drop_batches=frozenset({0}))
    gw = start_gateway(gateway, [backend_entry("v", emu, "vllm", **extra)], emu)
    client = gw.client()
    requests = conversations(seed=8, n=40)
    ask(client, requests[0])
    ask(client, requests[1])
    state = wait_for(lambda: kv_state(gw, "v"), lambda s: s["state"] != "waiting", what="the first batch heard")
    assert (state["state"], state["reason"], state["resets"]) == ("rebuilding", "joined late", {"joined late": 1})
    deadline = time.monotonic() + 60
    i = 2
    while kv_state(gw, "v")["state"] != "live":
        assert time.monotonic() < deadline, kv_state(gw, "v")
        ask(client, requests[i % len(requests)])
        i += 1
    assert kv_state(gw, "v")["reason"] == "rebuilt: predictions verified"
    expected, reported, _ = ask(client, requests[-1])
    assert expected == reported


def test_a_replayed_gap_stays_live(emulators: Emulators, gateway: Gateway, loop_thread: LoopThread) -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    emu, extra = publishing(emulators, "vllm", replay_endpoint=replay)
    gw = start_gateway(gateway, [backend_entry("v", emu, "vllm", **extra)], emu)
    client = gw.client()
    requests = conversations(seed=4, n=16)
    for n, messages in enumerate(requests):
        if n == 3:
            loop_thread.loop.call_soon_threadsafe(zmq_publisher(emu).drop_next, 2)
        expected, reported, _ = ask(client, messages)
        if n > 0:  # the first answer's events reach the gateway asynchronously: live within a deadline
            wait_for(lambda: kv_state(gw, "v")["state"], lambda st: st == "live", timeout=15, what="a live index")
    state = kv_state(gw, "v")
    assert state["resets"] == {}  # and it never left live: no gap was taken for a reset
    assert state["ranks"]["0"]["next_seq"] == zmq_publisher(emu).seq
    assert expected == reported


def test_a_silent_publisher_is_noticed(emulators: Emulators, gateway: Gateway, loop_thread: LoopThread) -> None:
    emu, extra = publishing(emulators, "vllm", silent_after_s=0.3)
    gw = start_gateway(gateway, [backend_entry("v", emu, "vllm", **extra)], emu)
    client = gw.client()
    requests = conversations(seed=5, n=10)
    ask(client, requests[0])
    wait_for(lambda: kv_state(gw, "v")["state"], lambda st: st == "live", what="a live index")  # events lag answers
    loop_thread.loop.call_soon_threadsafe(zmq_publisher(emu).silence)
    ask(client, [{"role": "user", "content": "a brand new prompt that must be stored " * 8}])
    state = wait_for(lambda: kv_state(gw, "v"), lambda s: s["state"] == "rebuilding", what="the silence noticed")
    assert state["reason"] == "silent"


def ask_when_up(gw: GatewayProcess, client: openai.OpenAI,
                messages: list[ChatCompletionMessageParam]) -> tuple[int, int, str]:
    """`ask`, once the gateway routes to the backend again (it may have seen it down)."""
    def attempt() -> tuple[int, int, str] | None:
        try:
            return ask(client, messages)
        except openai.APIError:
            return None

    got = wait_for(attempt, lambda r: r is not None, what="the backend back")
    assert got is not None
    return got


def test_a_restarted_engine_starts_an_empty_live_index(emulators: Emulators, gateway: Gateway) -> None:
    emu, extra = publishing(emulators, "vllm")
    port = int(emu.url.rsplit(":", 1)[1])
    endpoint = extra["kv_events"]["endpoint"]
    gw = start_gateway(gateway, [backend_entry("v", emu, "vllm", **extra)], emu)
    client = gw.client()
    requests = conversations(seed=6, n=6)
    for messages in requests[:3]:
        ask(client, messages)
    assert kv_state(gw, "v")["ranks"]["0"]["blocks"] > 0
    emulators.stop(emu)
    subscribed(emulators.start("vllm", kv_events=KvEventsConfig(endpoint=endpoint), block_size=16, num_kv_blocks=48,
                               port=port))
    # the first request reaches an empty engine; its batch (sequence 0 again) tells the gateway
    assert ask_when_up(gw, client, requests[0])[1] == 0
    state = wait_for(lambda: kv_state(gw, "v"), lambda s: s["resets"] == {"restart": 1}, what="the restart seen")
    assert state["state"] == "live"
    expected, reported, _ = ask(client, requests[0])
    assert expected == reported > 0


def test_connect_mode_and_the_admin_view(emulators: Emulators, gateway: Gateway, tmp_path: Path) -> None:
    """The engine binds (an ipc:// endpoint here; `tcp://*:5557` in production) and the gateway
    connects, as several gateway replicas would."""
    endpoint = f"ipc://{tmp_path}/kv.sock"
    emu = emulators.start("sglang", kv_events=KvEventsConfig(endpoint=endpoint), block_size=16, num_kv_blocks=64)
    gw = start_gateway(gateway, [backend_entry("s", emu, "sglang", kv_events={"endpoint": endpoint})])
    client = gw.client()
    for messages in conversations(seed=7, n=12):
        expected, reported, _ = ask(client, messages)
    state = kv_state(gw, "s")
    assert state["batches"] > 0
    assert state["last_event_age_s"] is not None
    assert set(state) >= {"state", "reason", "state_age_s", "last_event_age_s", "batches", "resets", "ranks",
                          "predictions_checked", "predictions_exact", "silent", "hint", "connected"}
    assert (state["connected"], state["silent"], state["hint"]) == (True, False, None)  # the socket monitor saw it
    # SGLang's /health generates, so its first batches may precede the subscription: the gateway
    # then joined late and rebuilt; either way it is live now and exact
    assert state["state"] == "live"
    assert expected == reported


def test_without_events_the_approximate_index_says_what_it_expected(emulators: Emulators, gateway: Gateway) -> None:
    emu = emulators.start("vllm")
    gw = gateway([backend_entry("v", emu, "vllm")], routes=[{"model": "moe", "backends": ["v"],
                                                              "policy": "prefix_affinity"}])
    client = gw.client()
    system = "A long shared system prompt for the approximate index. " * 20
    first = ask(client, [{"role": "system", "content": system}, {"role": "user", "content": "one"}])
    second = ask(client, [{"role": "system", "content": system}, {"role": "user", "content": "two"}])
    assert first[0] == 0
    assert second[0] > 0
    assert [b["kv_events"] for b in gw.get("/admin/backends").json()["backends"]] == [None]
    assert gw.metric("gateway_prefix_prediction_error_tokens_count", source="approximate") == 2
    assert httpx.get(gw.url + "/metrics").text.count("gateway_kv_events_live{") == 0


def ask_fresh(gw: GatewayProcess, messages: list[ChatCompletionMessageParam], model: str) -> tuple[int, int, str]:
    """`ask` on a connection of its own (so any worker of `--workers N` may answer it)."""
    with openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as client:
        return ask(client, messages, model)


def test_workers_each_hear_every_engine_once(emulators: Emulators, gateway: Gateway, tmp_path: Path) -> None:
    """`--workers 2`: a bound endpoint (only one process can bind it) and trtllm-serve's draining
    `/kv_cache_events` (two pollers would split the events) are heard once, by the supervisor,
    and relayed to both workers; an engine that binds its own publisher is subscribed to by each
    worker. Every worker's index is live for every backend and every prediction is exact."""
    bound, bound_kv = publishing(emulators, "vllm")
    trtllm, trtllm_kv = publishing(emulators, "trtllm", block_size=32)
    endpoint = f"ipc://{tmp_path}/kv.sock"
    connected = emulators.start("vllm", kv_events=KvEventsConfig(endpoint=endpoint), block_size=16, num_kv_blocks=48)
    backends = [backend_entry("bound", bound, "vllm", **bound_kv),
                backend_entry("trtllm", trtllm, "trtllm", **trtllm_kv),
                backend_entry("connected", connected, "vllm", kv_events={"endpoint": endpoint})]
    gw = gateway(backends, routes=[
        {"model": "moe", "backends": ["bound", "trtllm"], "policy": "prefix_affinity", "tokenizer": "emulator"},
        {"model": "solo", "backends": ["connected"], "policy": "prefix_affinity", "tokenizer": "emulator"},
    ], workers=2)
    requests = conversations(seed=11, n=60)
    models = ["moe", "solo"]
    # /metrics reads 1 for a backend once it is live on every worker (3 backends). A worker whose
    # subscription to the relay was still in flight when the first batches went out joined late: it
    # is live once answers verified its index, which takes requests enough on each worker (within a
    # deadline).
    i = 0
    deadline = time.monotonic() + 90
    while gw.metric("gateway_kv_events_live") < 3:
        ask_fresh(gw, requests[i % len(requests)], models[i % 2])
        i += 1
        assert time.monotonic() < deadline, [b["kv_events"] for b in gw.get("/admin/backends").json()["backends"]]
    served: set[str] = set()
    compared = 0
    for n, messages in enumerate(requests[:30]):
        expected, reported, backend = ask_fresh(gw, messages, models[n % 2])
        served.add(backend)
        assert expected == reported, (backend, expected, reported)
        compared += 1
    assert gw.metric("gateway_kv_events_live") == 3
    assert served == {"bound", "trtllm", "connected"}
    error = "gateway_prefix_prediction_error_tokens"
    assert gw.metric(f"{error}_bucket", source="exact", le="0.0") >= compared
