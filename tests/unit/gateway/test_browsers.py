"""The admin API's defences against the operator's browser (CSRF, DNS rebinding): the pure checks."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.access.browsers import json_typed, local_host, same_origin

PORTS = st.integers(1, 65535)
LABELS = st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True)


@given(address=st.ip_addresses(), port=st.none() | PORTS)
def test_a_literal_address_is_a_local_host_with_or_without_a_port(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int | None
) -> None:
    text = f"[{address}]" if address.version == 6 else str(address)
    assert local_host(text if port is None else f"{text}:{port}")


@given(labels=st.lists(LABELS, min_size=1, max_size=3), tld=st.sampled_from(["example", "com", "io", "test"]),
       port=st.none() | PORTS)
def test_a_name_that_is_not_loopback_is_refused_whatever_it_contains(labels: list[str], tld: str,
                                                                       port: int | None) -> None:
    for prefix in ([], ["localhost"], ["127.0.0.1"]):
        name = ".".join([*prefix, *labels, tld])
        assert not local_host(name if port is None else f"{name}:{port}"), name


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8080", "localhost.", "app.localhost:9", "[::1]:8080",
                                  "127.0.0.1:80", "10.1.2.3", None])
def test_loopback_names_and_addresses_are_local(host: str | None) -> None:
    assert local_host(host)


@pytest.mark.parametrize("host", ["", "evil.example", "evil.example:8080", "localhost.evil.example", "[::1",
                                  "[::1]x", "127.0.0.1:http", "127.0.0.1:0", "127.0.0.1:70000", "localhostx"])
def test_other_hosts_and_garbage_are_not(host: str) -> None:
    assert not local_host(host)


@pytest.mark.parametrize(("origin", "host"), [
    ("http://127.0.0.1:8080", "127.0.0.1:8080"), ("http://[::1]:8080", "[::1]:8080"),
    ("http://LOCALHOST:8080", "localhost:8080"), ("https://gw.example", "gw.example"),  # TLS ends in front
    ("https://gw.example:443", "gw.example"), ("http://gw.example", "gw.example:80"),
])
def test_the_gateways_own_origin(origin: str, host: str) -> None:
    assert same_origin(origin, host)


@pytest.mark.parametrize(("origin", "host"), [
    ("http://evil.example", "127.0.0.1:8080"), ("http://127.0.0.1:8081", "127.0.0.1:8080"),
    ("http://localhost:8080", "127.0.0.1:8080"), ("null", "127.0.0.1:8080"), ("http://127.0.0.1:8080", None),
    ("file:///home/op/x.html", "127.0.0.1:8080"), ("http://127.0.0.1:8080/path", "127.0.0.1:8080"), ("", "a"),
])
def test_a_foreign_origin(origin: str, host: str | None) -> None:
    assert not same_origin(origin, host)


def test_only_a_json_body_type_passes() -> None:
    assert json_typed({"content-type": "application/json"})
    assert json_typed({"content-type": "Application/JSON; charset=utf-8"})
    for other in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "application/jsonx", ""):
        assert not json_typed({"content-type": other})
    assert not json_typed({})
