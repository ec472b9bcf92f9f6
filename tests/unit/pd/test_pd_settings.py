"""The config of prefill/decode disaggregation: roles, bootstrap ports, a route's section, and the
discovered backends' roles (entries and pod labels)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.discovery.config import DiscoveryEntry
from gateway.discovery.endpoints import Endpoint, discovered
from gateway.discovery.kubernetes_objects import pod_endpoints, pod_role
from gateway.settings import ConfigError, Settings, parse_settings


def backend(name: str, role: str = "both", runtime: str = "vllm", **extra: Any) -> dict[str, Any]:
    port = 8000 + len(name)
    return {"name": name, "runtime": runtime, "url": f"http://127.0.0.1:{port}", "model": "m", "role": role, **extra}


def doc(*backends: dict[str, Any], disaggregation: dict[str, Any] | None = None) -> dict[str, Any]:
    route: dict[str, Any] = {"model": "m", "backends": [b["name"] for b in backends]}
    if disaggregation is not None:
        route["disaggregation"] = disaggregation
    return {"backends": list(backends), "routes": [route]}


def test_the_issue_shape_loads_with_its_defaults() -> None:
    s = parse_settings(doc(backend("vllm-p0", "prefill"), backend("vllm-d0", "decode"),
                           disaggregation={"when": "auto", "min_uncached_tokens": 2048}))
    spec = s.routes[0].disaggregation
    assert spec is not None
    assert (spec.when, spec.min_uncached_tokens, spec.handoff) == ("auto", 2048, "params")
    assert [b.role for b in s.backends] == ["prefill", "decode"]
    plain = parse_settings(doc(backend("a"), backend("b")))
    assert plain.backends[0].role == "both"
    assert plain.routes[0].disaggregation is None


def test_sglang_prefill_takes_a_bootstrap_port() -> None:
    s = parse_settings(doc(backend("sgl-p0", "prefill", "sglang", bootstrap_port=8998), backend("sgl-d0", "decode",
                           "sglang"), disaggregation={"when": "always"}))
    assert s.backends[0].bootstrap_port == 8998


@pytest.mark.parametrize(("config", "needle"), [
    (doc(backend("p", "prefill"), backend("p2", "prefill"), disaggregation={}), "no decode backend"),
    (doc(backend("d", "decode"), backend("d2", "decode"), disaggregation={}), "no prefill backend"),
    (doc(backend("solo"), disaggregation={"when": "always"}), "must be two servers"),
    (doc(backend("p", "prefill"), backend("d", "decode")), "give the route a `disaggregation:` section"),
    (doc(backend("p", "prefill"), backend("d", "decode", "sglang"), disaggregation={}), "one runtime per"),
    (doc(backend("p", "prefill"), backend("d", "decode"), disaggregation={"when": "always",
                                                                           "min_uncached_tokens": 5}),
     "min_uncached_tokens: only with `when: auto`"),
    (doc(backend("p", "prefill"), backend("d", "decode"), disaggregation={"when": "sometimes"}), "when"),
    (doc(backend("p", "prefill"), backend("d", "decode"), disaggregation={"whn": "auto"}), "whn"),
    (doc(backend("p", "prefill", "sglang"), backend("d", "decode", "sglang"), disaggregation={"handoff": "storage"}),
     "handoff"),
    (doc(backend("p", "leader")), "backends.0.role"),
    (doc(backend("t", "prefill", "triton")), "Triton has no disaggregated serving"),
    (doc(backend("p", "prefill", bootstrap_port=8998), backend("d", "decode"), disaggregation={}),
     "only SGLang prefill servers"),
    (doc(backend("p", "prefill", "sglang"), backend("d", "decode", "sglang", bootstrap_port=8998),
         disaggregation={}), "a decode backend has no bootstrap server"),
    (doc(backend("p", "prefill", "sglang"), backend("d", "decode", "sglang"), disaggregation={"when": "auto"}),
     "decode-mode SGLang server refuses a request without a bootstrap room"),
    (doc(backend("p", "prefill", "sglang"), backend("d", "decode", "sglang"), disaggregation={"when": "never"}),
     "add a `role: both` server"),
])
def test_bad_disaggregation_configs_fail_naming_the_problem(config: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_settings(config)


def test_never_keeps_the_section_without_needing_a_pair() -> None:
    s = parse_settings(doc(backend("p", "prefill"), disaggregation={"when": "never"}))
    assert s.routes[0].disaggregation is not None
    assert s.routes[0].disaggregation.when == "never"


def test_both_backends_may_form_a_pair_and_storage_handoff_is_vllms() -> None:
    s = parse_settings(doc(backend("a"), backend("b"), disaggregation={"handoff": "storage"}))
    assert s.routes[0].disaggregation is not None
    assert s.routes[0].disaggregation.handoff == "storage"


ENTRY: dict[str, Any] = {"name": "sgl", "runtime": "sglang", "model": "m", "dns": {"host": "sgl.svc", "port": 30000}}


def test_a_discovery_entry_gives_its_backends_role_and_bootstrap_port() -> None:
    entry = DiscoveryEntry.model_validate({**ENTRY, "role": "prefill", "bootstrap_port": 9000})
    found = discovered(entry, Endpoint.of("10.0.0.1", 30000))
    from gateway.settings import Backend

    made = Backend.model_validate(found.settings())
    assert (made.role, made.bootstrap_port) == ("prefill", 9000)


def test_a_pod_says_its_own_role_and_bootstrap_port_over_the_entrys() -> None:
    entry = DiscoveryEntry.model_validate({**ENTRY, "dns": None, "kubernetes": {"label_selector": "app=sgl",
                                                                                "port": 30000}})
    pod = {"metadata": {"labels": {"sglang.ai/role": "prefill"}, "annotations": {"sglang.ai/bootstrap-port": "8999"}},
           "status": {"phase": "Running", "podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]}}
    (endpoint,) = pod_endpoints(30000)(pod)
    assert (endpoint.role, endpoint.bootstrap_port) == ("prefill", 8999)
    fields = discovered(entry, endpoint).fields
    assert (fields["role"], fields["bootstrap_port"]) == ("prefill", 8999)
    assert pod_role({"labels": {"llm-d.ai/role": "decode"}}) == ("decode", 0)
    assert pod_role({"labels": {"llm-d.ai/role": "boss"}, "annotations": {"sglang.ai/bootstrap-port": "x"}}) == ("", 0)


def test_a_kubernetes_pool_may_hold_either_role() -> None:
    entry = {**ENTRY, "dns": None, "kubernetes": {"label_selector": "app=sgl", "port": 30000}}
    s = Settings.model_validate({"discovery": [entry], "routes": [{"model": "m", "backends": ["sgl"],
                                                                   "disaggregation": {"when": "always"}}]})
    assert s.routes[0].disaggregation is not None


def test_ab_arms_may_be_topologies() -> None:
    backends = [backend("agg0"), backend("agg1"), backend("p", "prefill"), backend("d", "decode")]
    arms = [{"name": "aggregated", "weight": 1, "backends": ["agg0", "agg1"], "disaggregation": {"when": "never"}},
            {"name": "pd", "weight": 1, "backends": ["p", "d"], "disaggregation": {"when": "always"}}]
    s = parse_settings({"backends": backends, "routes": [{"model": "m", "split": {"arms": arms}}]})
    route = s.routes[0]
    assert route.disaggregates
    assert route.split is not None
    assert [a.disaggregation.when for a in route.split.arms if a.disaggregation] == ["never", "always"]
    bad = [{**arms[0]}, {**arms[1], "disaggregation": None}]  # the pd arm without a section: its prefill is idle
    with pytest.raises(ConfigError, match=r"routes\.0\.split\.arms\.1\.backends: \['p'\] have `role: prefill`"):
        parse_settings({"backends": backends, "routes": [{"model": "m", "split": {"arms": bad}}]})


def test_an_sglang_route_keeps_requests_whole_only_with_a_null_mode_server() -> None:
    s = parse_settings(doc(backend("p", "prefill", "sglang"), backend("d", "decode", "sglang"),
                           backend("n", "both", "sglang"), disaggregation={"when": "auto"}))
    assert s.routes[0].disaggregation is not None
    assert s.routes[0].disaggregation.when == "auto"
