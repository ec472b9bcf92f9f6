"""Which backends' KV events the supervisor must hear for its workers, and where it relays them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.kvcache.intake import relay_endpoint, relayed
from gateway.settings import Backend


def backend(runtime: str, **kv: Any) -> Backend:
    return Backend.model_validate({"name": "b", "url": "http://127.0.0.1:1", "runtime": runtime, "model": "m",
                                   "kv_events": kv})


def test_only_what_one_process_may_hear_is_relayed() -> None:
    assert relayed(backend("vllm", endpoint="tcp://127.0.0.1:5557", bind=True))  # one process can bind it
    assert relayed(backend("trtllm"))  # its /kv_cache_events drains: one poller
    assert not relayed(backend("sglang", endpoint="tcp://127.0.0.1:5557"))  # every worker connects itself
    plain = {"name": "b", "url": "http://127.0.0.1:1", "runtime": "vllm", "model": "m"}
    assert not relayed(Backend.model_validate(plain))


def test_relay_endpoints_are_per_backend_ipc_sockets_in_the_directory() -> None:
    a, b = relay_endpoint(Path("/run/gw"), "a/b c"), relay_endpoint(Path("/run/gw"), "a/b d")
    assert a.startswith("ipc:///run/gw/kv-")
    assert a != b
    assert "/" not in a.removeprefix("ipc:///run/gw/")
    assert a == relay_endpoint(Path("/run/gw"), "a/b c")  # the hub and its workers agree on it
