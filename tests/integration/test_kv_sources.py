"""Two ways a KV-event source misleads routing, against a real gateway and emulators publishing as
vLLM does: an engine restart whose first batches the gateway missed (its index must not claim to
be exact until a replay or the engine's reported cached tokens verified it), and a source that
never hears anything because both sides connect (it must say so: `/admin/backends`, the log, a
metric)."""

from __future__ import annotations

import time

import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends.emulator import KvEventsConfig

from .harness import Emulators, backend_entry, wait_for
from .test_kv_events import (
    Gateway,
    ask,
    ask_when_up,
    free_port,
    kv_state,
    publishing,
    start_gateway,
    subscribed,
    zmq_publisher,
)

DOC: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "A shared document the engine caches. " + " ".join(f"d{i}" for i in range(300))},
    {"role": "user", "content": "Summarise it."},
]


def small(i: int) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": f"short question number {i}"}]


@pytest.mark.parametrize("buffer_steps", [10_000, 1], ids=["replayed", "replay-too-short"])
def test_a_restart_whose_first_batches_were_missed_is_not_exact_until_verified(
    emulators: Emulators, gateway: Gateway, buffer_steps: int,
) -> None:
    """The engine restarts; the gateway misses its first two batches (the first holds a 256+ token
    document). With the whole new sequence in the replay buffer, the replay fills it and the index
    is live and exact again; with a buffer too short for it, the index rebuilds (not live) until
    answers verified it. Either way the document's cached tokens are then predicted as reported."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    emu, extra = publishing(emulators, "vllm", replay_endpoint=replay, blocks=64)
    port = int(emu.url.rsplit(":", 1)[1])
    endpoint = extra["kv_events"]["endpoint"]
    gw = start_gateway(gateway, [backend_entry("v", emu, "vllm", **extra)], emu)
    client = gw.client()
    for i in range(6):
        ask(client, small(100 + i))
    before = wait_for(lambda: kv_state(gw, "v"), lambda s: s["state"] == "live"
                      and s["ranks"]["0"]["next_seq"] == zmq_publisher(emu).seq, what="every batch heard")
    assert before["ranks"]["0"]["next_seq"] >= 6  # the restarted engine's first heard batch is below it

    emulators.stop(emu)
    restarted = emulators.start("vllm", kv_events=KvEventsConfig(
        endpoint=endpoint, replay_endpoint=replay, drop_batches=frozenset({0, 1}), buffer_steps=buffer_steps,
    ), block_size=16, num_kv_blocks=64, port=port)
    subscribed(restarted)
    pub = zmq_publisher(restarted)
    assert ask_when_up(gw, client, DOC)[1] == 0  # a fresh engine: its batch 0 (the document's blocks) is missed
    i = 0
    while pub.sent == 0:  # batches 0 and 1 are missed; the next one reaches the gateway
        ask(client, small(i))
        i += 1
        assert i < 20
    state = wait_for(lambda: kv_state(gw, "v"), lambda s: s["ranks"]["0"]["next_seq"] == pub.seq,
                     what="the restarted engine's batches heard")
    if buffer_steps > 1:
        # the replay returned the new process's batches from 0: the document is known, exactly
        expected, reported, _ = ask(client, DOC)
        assert reported >= 256
        assert expected == reported
        state = kv_state(gw, "v")
        assert (state["state"], state["reason"]) == ("live", "replayed from the engine's start"), state
    else:
        # its batches 0 and 1 are gone from the buffer: the index must not claim to be exact
        assert (state["state"], state["reason"]) == ("rebuilding", "restart"), state
        checked = state["predictions_checked"]
        expected, reported, _ = ask(client, DOC)
        assert reported >= 256
        state = kv_state(gw, "v")
        assert state["state"] != "live" or state["reason"] == "rebuilt: predictions verified"
        assert state["predictions_checked"] == checked  # nothing was claimed exact meanwhile
        deadline = time.monotonic() + 60
        while kv_state(gw, "v")["state"] != "live":  # the engine's reports verify the rebuilt index
            assert time.monotonic() < deadline, kv_state(gw, "v")
            ask(client, DOC if i % 2 else small(i))
            i += 1
        assert kv_state(gw, "v")["reason"] == "rebuilt: predictions verified"
        expected, reported, _ = ask(client, DOC)
        assert reported >= 256
        assert expected == reported
    assert kv_state(gw, "v")["resets"] == {"restart": 1}


def test_a_source_that_never_hears_anything_says_why(emulators: Emulators, gateway: Gateway) -> None:
    """The engine was given a concrete address, so it connects (as vLLM and SGLang do), and the
    gateway's `kv_events` left `bind` out, so it connects too: nobody binds, nothing arrives. Once
    responses showed the engine stored blocks and `silent_after_s` passed, the source is `silent`
    in /admin/backends with the cause and the fix, logged once, and counted in a metric."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    emu = emulators.start("vllm", kv_events=KvEventsConfig(endpoint=endpoint), block_size=16, num_kv_blocks=64)
    gw = start_gateway(gateway, [backend_entry("v", emu, "vllm",
                                               kv_events={"endpoint": endpoint, "silent_after_s": 0.5})])
    client = gw.client()
    assert kv_state(gw, "v")["state"] == "waiting"
    i = 0

    def silent() -> bool:
        nonlocal i
        ask(client, [{"role": "system", "content": " ".join(f"s{i}-{n}" for n in range(200))},
                     {"role": "user", "content": "hello"}])
        i += 1
        return bool(kv_state(gw, "v")["state"] == "silent")

    wait_for(silent, lambda s: s, timeout=30, what="the source reported silent")
    state = kv_state(gw, "v")
    assert (state["reason"], state["silent"], state["connected"], state["batches"]) == (
        "no KV event ever arrived", True, False, 0)
    hint = state["hint"]
    assert hint.startswith(f"no KV event ever arrived from {endpoint}")
    port = endpoint.rsplit(":", 1)[1]
    for phrase in ("nothing accepted the gateway's connection", "`kv_events.bind: true` on backend v",
                   f"endpoint tcp://*:{port}"):
        assert phrase in hint, hint
    assert gw.metric("gateway_kv_events_silent", backend="v") == 1
    assert gw.metric("gateway_kv_events_live", backend="v") == 0
    for n in range(3):  # more evidence, more ticks: still one line
        ask(client, [{"role": "user", "content": " ".join(f"again{n}-{k}" for k in range(200))}])
    wait_for(lambda: gw.log_path.read_text(), lambda log: hint in log, what="the log line")
    since = kv_state(gw, "v")["state_age_s"]  # the last evidence came before: give it silent_after_s and 2 ticks
    wait_for(lambda: kv_state(gw, "v")["state_age_s"], lambda age: age > since + 2.6, what="a few ticks more")
    assert gw.log_path.read_text().count("no KV event ever arrived") == 1
