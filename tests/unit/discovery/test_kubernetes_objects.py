"""Payloads shaped as a real API server sends them (discovery.k8s.io/v1 EndpointSlice, v1 Pod)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.discovery.endpoints import Endpoint
from gateway.discovery.kubernetes_objects import (
    ApiStatusError,
    ResourceExpired,
    Store,
    WatchEvent,
    WatchProtocolError,
    parse_event,
    parse_list,
    pod_endpoints,
    slice_endpoints,
    status_error,
)


def endpoint_slice(name: str, *endpoints: tuple[str, bool | None], ports: list[dict[str, Any]] | None = None,
                   ) -> dict[str, Any]:
    return {
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": "llm", "resourceVersion": "7",
                     "labels": {"kubernetes.io/service-name": "vllm"}},
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [ip], "conditions": {} if ready is None else {"ready": ready, "serving": ready}}
            for ip, ready in endpoints
        ],
        "ports": ports if ports is not None else [{"name": "http", "port": 8000, "protocol": "TCP"}],
    }


def pod(name: str, ip: str | None, *, phase: str = "Running", ready: str = "True", deleting: bool = False,
        ) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "llm", "resourceVersion": "9", "labels": {"app": "sglang"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T08:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": [
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": ready}]}
    if ip:
        status["podIP"] = ip
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "status": status}


def test_a_slice_contributes_its_ready_endpoints_and_unknown_means_ready() -> None:
    obj = endpoint_slice("vllm-abc", ("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None))
    assert slice_endpoints("http")(obj) == {Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.3", 8000)}


@pytest.mark.parametrize(("port", "expected"), [
    ("metrics", 9090), ("http", 8000), (9090, 9090), (8000, 8000), (1234, None), ("grpc", None), (None, None),
])
def test_the_slice_port_is_chosen_by_name_or_number(port: int | str | None, expected: int | None) -> None:
    ports = [{"name": "http", "port": 8000}, {"name": "metrics", "port": 9090}]
    found = slice_endpoints(port)(endpoint_slice("s", ("10.0.0.1", True), ports=ports))
    assert found == (set() if expected is None else {Endpoint("10.0.0.1", expected)})


def test_a_single_port_slice_needs_no_port_and_only_the_first_address_counts() -> None:
    obj = endpoint_slice("s", ports=[{"port": 8000}])
    obj["endpoints"] = [{"addresses": ["fd00::1", "fd00::2"], "conditions": {"ready": True}}, {"addresses": []}]
    assert slice_endpoints(None)(obj) == {Endpoint("fd00::1", 8000)}


def test_a_slice_without_endpoints_or_ports_contributes_nothing() -> None:
    assert slice_endpoints("http")({"metadata": {"name": "s"}, "endpoints": None, "ports": None}) == set()


@pytest.mark.parametrize(("obj", "serving"), [
    (pod("p", "10.1.0.1"), True),
    (pod("p", "10.1.0.1", ready="False"), False),
    (pod("p", "10.1.0.1", phase="Pending"), False),
    (pod("p", "10.1.0.1", phase="Succeeded"), False),
    (pod("p", None), False),
    (pod("p", "10.1.0.1", deleting=True), False),
])
def test_only_running_ready_pods_with_an_ip_serve(obj: dict[str, Any], serving: bool) -> None:
    assert pod_endpoints(30000)(obj) == ({Endpoint("10.1.0.1", 30000)} if serving else set())


def test_watch_events_parse_and_errors_are_statuses() -> None:
    event = parse_event(orjson.dumps({"type": "MODIFIED", "object": pod("p", "10.1.0.1")}) + b"\n")
    assert (event.type, event.key, event.resource_version) == ("MODIFIED", "llm/p", "9")
    bookmark = parse_event(b'{"type":"BOOKMARK","object":{"kind":"Pod","metadata":{"resourceVersion":"42"}}}')
    assert (bookmark.type, bookmark.resource_version) == ("BOOKMARK", "42")
    gone = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                        "message": "too old resource version: 3 (9)", "reason": "Expired", "code": 410}}
    with pytest.raises(ResourceExpired, match="410 Expired: too old resource version"):
        parse_event(orjson.dumps(gone))
    forbidden = {"type": "ERROR", "object": {"kind": "Status", "code": 403, "reason": "Forbidden", "message": "no"}}
    with pytest.raises(ApiStatusError) as caught:
        parse_event(orjson.dumps(forbidden))
    assert caught.value.code == 403
    assert not isinstance(caught.value, ResourceExpired)


@pytest.mark.parametrize("line", [b"<html>", b'{"type":"ADDED"}', b'{"type":"RESIZED","object":{}}', b"[1]"])
def test_malformed_watch_lines_are_protocol_errors(line: bytes) -> None:
    with pytest.raises(WatchProtocolError):
        parse_event(line)


def test_a_status_without_a_code_takes_the_http_status() -> None:
    assert isinstance(status_error(None, http_status=410), ResourceExpired)
    assert status_error({"kind": "Status", "message": "x"}, http_status=503).code == 503


def test_list_pages_carry_the_version_and_the_continue_token() -> None:
    page = parse_list(orjson.dumps({"kind": "PodList", "metadata": {"resourceVersion": "12", "continue": "abc"},
                                    "items": [pod("a", "10.1.0.1")]}))
    assert (page.resource_version, page.continue_token, len(page.items)) == ("12", "abc", 1)
    assert parse_list(b'{"metadata":{"resourceVersion":"3"},"items":null}').items == []
    with pytest.raises(WatchProtocolError):
        parse_list(b'{"items":[]}')


def test_the_store_follows_events_and_a_relist_forgets_what_is_gone() -> None:
    store = Store(pod_endpoints(30000))
    store.replace([pod("a", "10.1.0.1"), pod("b", "10.1.0.2")])
    assert store.endpoints() == {Endpoint("10.1.0.1", 30000), Endpoint("10.1.0.2", 30000)}
    store.apply(WatchEvent("MODIFIED", pod("a", "10.1.0.1", ready="False")))
    store.apply(WatchEvent("ADDED", pod("c", "10.1.0.3")))
    store.apply(WatchEvent("DELETED", pod("b", "10.1.0.2")))
    store.apply(WatchEvent("BOOKMARK", {"metadata": {"resourceVersion": "50"}}))
    assert store.endpoints() == {Endpoint("10.1.0.3", 30000)}
    store.replace([pod("d", "10.1.0.4")])
    assert store.endpoints() == {Endpoint("10.1.0.4", 30000)}


def test_one_endpoint_in_two_slices_counts_once_and_stays_while_either_has_it() -> None:
    store = Store(slice_endpoints("http"))
    store.replace([endpoint_slice("s1", ("10.0.0.1", True)), endpoint_slice("s2", ("10.0.0.1", True))])
    assert store.endpoints() == {Endpoint("10.0.0.1", 8000)}
    store.apply(WatchEvent("DELETED", endpoint_slice("s1")))
    assert store.endpoints() == {Endpoint("10.0.0.1", 8000)}
