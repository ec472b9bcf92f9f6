from __future__ import annotations

from typing import Any

from gateway.discovery.config import DiscoveryEntry
from gateway.discovery.endpoints import Endpoint, backends_of, discovered
from gateway.settings import Backend

TRITON: dict[str, Any] = {
    "name": "trt", "runtime": "triton", "model": "m", "usd_per_hour": 24.5, "metrics_port": 8002,
    "chat_template": "llama3", "api_key_env": "TRT_KEY", "dns": {"host": "trt.example", "port": 8000},
}


def test_ipv6_addresses_are_bracketed_and_normalised() -> None:
    assert Endpoint.of("127.0.0.2", 8000).authority == "127.0.0.2:8000"
    assert Endpoint.of("0:0::0001", 8000) == Endpoint("::1", 8000)
    assert Endpoint.of("::1", 8000).authority == "[::1]:8000"
    assert Endpoint.of("Pod-1.Example.", 80) == Endpoint("pod-1.example", 80)


def test_a_discovered_backend_takes_every_field_but_name_and_url_from_the_entry() -> None:
    entry = DiscoveryEntry.model_validate(TRITON)
    backend = discovered(entry, Endpoint("127.0.0.2", 8000))
    assert backend.name == "trt-127.0.0.2:8000"
    assert backend.url == "http://127.0.0.2:8000"
    config = Backend.model_validate(backend.settings())
    assert config.base_url == "http://127.0.0.2:8000"
    assert str(config.metrics_url) == "http://127.0.0.2:8002/"
    assert (config.runtime, config.model, config.usd_per_hour) == ("triton", "m", 24.5)
    assert (config.chat_template, config.api_key_env) == ("llama3", "TRT_KEY")


def test_ipv6_backends_get_bracketed_names_and_urls() -> None:
    entry = DiscoveryEntry.model_validate(TRITON)
    backend = discovered(entry, Endpoint("fd00::7", 8000))
    assert (backend.name, backend.url) == ("trt-[fd00::7]:8000", "http://[fd00::7]:8000")
    assert backend.fields["metrics_url"] == "http://[fd00::7]:8002"


def test_backends_come_in_a_stable_order() -> None:
    entry = DiscoveryEntry.model_validate(TRITON)
    endpoints = frozenset({Endpoint("127.0.0.3", 1), Endpoint("127.0.0.2", 2), Endpoint("127.0.0.2", 1)})
    names = [b.name for b in backends_of(entry, endpoints)]
    assert names == ["trt-127.0.0.2:1", "trt-127.0.0.2:2", "trt-127.0.0.3:1"]
