from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from gateway.discovery.config import DiscoveryEntry, duplicate_entry_names, parse_nameserver
from gateway.discovery.hysteresis import LITERAL, Hold

DNS: dict[str, Any] = {
    "name": "vllm-pool", "runtime": "vllm", "model": "deepseek-v3", "usd_per_hour": 96,
    "dns": {"host": "vllm-headless.llm.svc.cluster.local", "port": 8000},
}
KUBE: dict[str, Any] = {
    "name": "sglang-pool", "runtime": "sglang", "model": "deepseek-v3",
    "kubernetes": {"namespace": "llm", "label_selector": "app=sglang", "port": 30000},
}

DOC = """\
- name: vllm-pool
  runtime: vllm
  model: deepseek-v3
  usd_per_hour: 96
  dns: {host: vllm-headless.llm.svc.cluster.local, port: 8000, interval_s: 5, resolver: "127.0.0.1:5353"}
- name: sglang-pool
  runtime: sglang
  model: deepseek-v3
  kubernetes: {namespace: llm, label_selector: "app=sglang", port: 30000}
- name: trt-pool
  runtime: triton
  model: deepseek-v3
  metrics_port: 8002
  kubernetes: {service: triton, port: http, kubeconfig: /etc/kube/config, context: prod}
- name: srv-pool
  runtime: vllm
  model: deepseek-v3
  dns: {srv: _http._tcp.vllm.llm.svc.cluster.local}
"""


def test_the_documented_shapes_load() -> None:
    entries = [DiscoveryEntry.model_validate(e) for e in yaml.safe_load(DOC)]
    assert [e.kind for e in entries] == ["dns", "kubernetes", "kubernetes", "dns"]
    assert entries[0].dns is not None
    assert entries[0].dns.nameserver == ("127.0.0.1", 5353)
    assert entries[0].dns.interval_s == 5
    assert entries[2].kubernetes is not None
    assert entries[2].kubernetes.port == "http"
    assert entries[3].dns is not None
    assert entries[3].dns.port is None


@pytest.mark.parametrize(("patch", "needle"), [
    ({"runtime": "tgi"}, "runtime"),
    ({"url": "http://x:1"}, "url"),  # the URL comes from discovery
    ({"name": "a:b"}, "name"),
    ({"name": "x" * 41}, "name"),
    ({"dns": {**DNS["dns"], "interval_s": 0}}, "dns.interval_s"),
    ({"dns": {**DNS["dns"], "hostt": "x"}}, "dns.hostt"),
    ({"dns": {"host": "a.example"}}, "port: required"),
    ({"dns": {"srv": "_http._tcp.a", "port": 80}}, "port: not allowed"),
    ({"dns": {"host": "a", "port": 1, "srv": "_http._tcp.a"}}, "exactly one of `host`"),
    ({"dns": {**DNS["dns"], "resolver": "dns.example:53"}}, "dns.resolver"),
    ({"dns": {**DNS["dns"], "resolver": "127.0.0.1:99999"}}, "dns.resolver"),
    ({"dns": {**DNS["dns"], "leave_after_answers": 0}}, "dns.leave_after_answers"),
    ({"dns": {**DNS["dns"], "leave_after_s": -1}}, "dns.leave_after_s"),
    ({"remember_s": -1}, "remember_s"),
    ({"kubernetes": KUBE["kubernetes"]}, "exactly one of `dns` and `kubernetes`"),
    ({"api_key_env": "K", "api_key_file": "/k"}, "at most one"),
])
def test_bad_dns_entries_fail_naming_the_field(patch: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        DiscoveryEntry.model_validate(DNS | patch)


@pytest.mark.parametrize(("kube", "needle"), [
    ({"label_selector": "app=x"}, "port number is required"),
    ({"label_selector": "app=x", "port": "http"}, "port number is required"),
    ({"service": "svc", "label_selector": "app=x", "port": 1}, "exactly one of `service`"),
    ({"service": "Bad_Name"}, "kubernetes.service"),
    ({"service": "svc", "context": "prod"}, "context: only with `kubeconfig`"),
    ({"service": "svc", "namespace": "UPPER"}, "kubernetes.namespace"),
    ({"service": "svc", "watch": True}, "kubernetes.watch"),
])
def test_bad_kubernetes_entries_fail_naming_the_field(kube: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        DiscoveryEntry.model_validate(KUBE | {"kubernetes": kube})


def test_dns_answers_are_held_and_kubernetes_answers_followed_literally() -> None:
    dns = DiscoveryEntry.model_validate(DNS)
    assert dns.hold == Hold(answers=3, seconds=60.0)  # the defaults: subsets of the records drain nothing
    assert dns.remember_s == 3600.0  # a backend that returns within the hour gets its history back
    literal = DiscoveryEntry.model_validate(DNS | {"dns": {**DNS["dns"], "leave_after_answers": 1,
                                                           "leave_after_s": 0}})
    assert literal.hold == LITERAL
    kube = DiscoveryEntry.model_validate(KUBE | {"remember_s": 0})
    assert (kube.hold, kube.remember_s) == (LITERAL, 0.0)
    with pytest.raises(ValidationError, match=r"kubernetes\.leave_after_s"):  # a watch has no hold
        DiscoveryEntry.model_validate(KUBE | {"kubernetes": {**KUBE["kubernetes"], "leave_after_s": 5}})


def test_entries_are_frozen() -> None:
    entry = DiscoveryEntry.model_validate(KUBE)
    with pytest.raises(ValidationError):
        entry.model = "other"  # type: ignore[misc]


@pytest.mark.parametrize(("text", "parsed"), [
    ("10.0.0.10", ("10.0.0.10", 53)),
    ("127.0.0.1:5353", ("127.0.0.1", 5353)),
    ("::1", ("::1", 53)),
    ("[::1]:5353", ("::1", 5353)),
    ("[fd00::a]", ("fd00::a", 53)),
])
def test_nameservers_parse(text: str, parsed: tuple[str, int]) -> None:
    assert parse_nameserver(text) == parsed


@pytest.mark.parametrize("text", ["resolver.local", "[::1", "[::1]x", "1.2.3.4:0", "1.2.3.4:x"])
def test_bad_nameservers_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"."):
        parse_nameserver(text)


def test_duplicate_names_across_entries_and_static_backends() -> None:
    entries = [DiscoveryEntry.model_validate(DNS), DiscoveryEntry.model_validate(KUBE)]
    assert duplicate_entry_names(entries, ["vllm-a"]) == []
    assert duplicate_entry_names(entries, ["sglang-pool"]) == ["sglang-pool"]
    assert duplicate_entry_names([*entries, entries[0]], []) == ["vllm-pool"]
