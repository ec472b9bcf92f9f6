"""What a silent KV-event source's log line and hint say: the likely cause and the fix, by which
side binds (vLLM and SGLang bind a wildcard or ipc:// endpoint and connect to a concrete address)
and by what the socket monitor saw."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.kvcache.silence import explain
from gateway.settings import Backend


def backend(runtime: str = "vllm", **kv: Any) -> Backend:
    return Backend.model_validate({"name": "v", "url": "http://10.0.0.5:8000", "runtime": runtime, "model": "m",
                                   "kv_events": kv})


@pytest.mark.parametrize(("kv", "connected", "says"), [
    # both connect: the engine was given a concrete address
    ({"endpoint": "tcp://10.0.0.5:5557"}, False,
     ["from tcp://10.0.0.5:5557", "nothing accepted", "connects to that address", "`kv_events.bind: true`",
      "endpoint tcp://*:5557"]),
    # both bind: the engine was given a wildcard
    ({"endpoint": "tcp://10.0.0.9:5560", "bind": True}, False,
     ["at tcp://10.0.0.9:5560", "no publisher connected", "bind it themselves", "remove `bind` from backend v",
      "tcp://<engine host>:5560"]),
    # under --workers N the supervisor binds: whether anyone connected is not known here
    ({"endpoint": "tcp://10.0.0.9:5560", "bind": True}, None, ["if no publisher connected"]),
    ({"endpoint": "ipc:///run/kv.sock", "bind": True}, False, ["bind ipc:// endpoints themselves",
                                                              "remove `kv_events.bind`"]),
    ({"endpoint": "ipc:///run/kv.sock"}, False, ["nothing is bound at that path"]),
    # connected, and still nothing: the engine does not publish, or on another topic
    ({"endpoint": "tcp://10.0.0.5:5557", "topic": "kv"}, True,
     ["a publisher is connected", "enable_kv_cache_events", "starts with `kv_events.topic` ('kv')",
      "prefix caching"]),
    ({"endpoint": "tcp://10.0.0.5:5557"}, True, ["subscribes to all"]),
])
def test_a_source_that_never_heard_anything_names_the_cause_and_the_fix(kv: dict[str, Any], connected: bool | None,
                                                                         says: list[str]) -> None:
    text = explain(backend(**kv), heard=False, connected=connected)
    assert text.startswith("no KV event ever arrived ")
    for phrase in says:
        assert phrase in text, (phrase, text)


def test_trtllm_and_a_stopped_publisher() -> None:
    text = explain(backend("trtllm"), heard=False, connected=None)
    assert "http://10.0.0.5:8000/kv_cache_events" in text
    assert "event_buffer_max_size" in text
    stopped = explain(backend(endpoint="tcp://10.0.0.5:5557", silent_after_s=2.5), heard=True, connected=True)
    assert stopped.startswith("KV events from tcp://10.0.0.5:5557 stopped: no batch within 2.5 s")


def test_a_bind_that_keeps_failing_says_who_else_binds() -> None:
    text = explain(backend(endpoint="tcp://127.0.0.1:5557", bind=True), heard=False, connected=False,
                   failed="Address already in use")
    assert "cannot bind it (Address already in use)" in text
    assert "has a wildcard (tcp://*:PORT) or is ipc:// binds it itself" in text
