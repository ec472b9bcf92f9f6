from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from gateway.__main__ import main
from gateway.settings import ConfigError, load_settings, parse_settings

VLLM = {"name": "vllm-a", "runtime": "vllm", "url": "http://127.0.0.1:8001", "model": "tiny-moe", "usd_per_hour": 28.0}
BASE: dict[str, Any] = {
    "listen": {"host": "127.0.0.1", "port": 8080},
    "backends": [VLLM],
    "routes": [{"model": "deepseek-v3", "backends": ["vllm-a"], "policy": "least_load"}],
}

DOC = """\
listen: {host: 127.0.0.1, port: 8080}
backends:
  - name: vllm-a                # unique; used as the `backend` label everywhere
    runtime: vllm               # vllm | sglang | trtllm (trtllm-serve) | triton (Triton + TRT-LLM backend)
    url: http://127.0.0.1:8001
    model: tiny-moe             # the model name this backend serves (the gateway rewrites `model` to it)
    usd_per_hour: 28.0          # optional: what this backend costs to run (e.g. 8 GPUs x 3.5)
routes:
  - model: deepseek-v3          # the model name clients send
    backends: [vllm-a]          # which backends may serve it
    policy: least_load          # round_robin | least_load (more policies come with the routing issue)
"""


def test_the_documented_shape_loads_exactly_as_written(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(DOC)
    settings = load_settings(path)
    assert settings.listen.port == 8080
    assert settings.backends[0].base_url == "http://127.0.0.1:8001"
    assert settings.backends[0].usd_per_hour == 28.0
    assert settings.routes[0].policy == "least_load"


def _patched(path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node: Any = doc
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    node[int(last) if last.isdigit() else last] = value
    return doc


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        (_patched("backends.0.runtime", "tgi"), "backends.0.runtime"),
        (_patched("backends.0.urll", "x"), "backends.0.urll"),
        (_patched("backends.0.url", "not a url"), "backends.0.url"),
        (_patched("routes.0.policy", "random"), "routes.0.policy"),
        (_patched("routes.0.backends", ["nope"]), "routes.0.backends"),
        (_patched("listen.port", 70000), "listen.port"),
        (_patched("backends.0.usd_per_hour", -1), "backends.0.usd_per_hour"),
        (_patched("surprise", 1), "surprise"),
        ({**BASE, "backends": [VLLM, VLLM]}, "duplicate backend names"),
    ],
)
def test_bad_config_fails_loudly_naming_the_field(doc: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings(doc)
    assert any(needle in line for line in info.value.errors), info.value.errors


def test_check_config_prints_every_error_with_its_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(DOC.replace("runtime: vllm", "runtime: tgi").replace("port: 8080", "port: 8080, extra: 1"))
    assert main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "backends.0.runtime" in err
    assert "listen.extra" in err


def test_check_config_accepts_a_good_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "good.yaml"
    path.write_text(DOC)
    assert main(["check-config", str(path)]) == 0
    assert "OK" in capsys.readouterr().out


def test_shipped_configs_are_valid() -> None:
    root = Path(__file__).resolve().parents[3] / "config"
    files = sorted(root.glob("*.yaml"))
    assert files, "config/ ships example configs"
    for f in files:
        load_settings(f)


POOL = {"name": "vllm-pool", "runtime": "vllm", "model": "tiny-moe", "usd_per_hour": 96,
        "dns": {"host": "vllm.llm.svc.cluster.local", "port": 8000}}


def test_a_discovery_only_config_is_valid_and_routes_name_the_pool() -> None:
    settings = parse_settings({"discovery": [POOL], "routes": [{"model": "m", "backends": ["vllm-pool"]}]})
    assert settings.backends == []
    assert settings.discovery[0].name == "vllm-pool"
    split = parse_settings({
        "backends": [VLLM], "discovery": [POOL],
        "routes": [{"model": "m", "split": {"arms": [{"name": "a", "weight": 1, "backends": ["vllm-pool"]},
                                                     {"name": "b", "weight": 1, "backends": ["vllm-a"]}]}}],
    })
    assert split.routes[0].candidates == ["vllm-pool", "vllm-a"]


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"routes": BASE["routes"]}, "give `backends`, `discovery` or both"),
        ({**BASE, "discovery": [{**POOL, "name": "vllm-a"}]}, "discovery: names used twice"),
        ({**BASE, "discovery": [POOL, POOL]}, "discovery: names used twice"),
        ({**BASE, "discovery": [{**POOL, "dns": {"host": "x"}}]}, "discovery.0.dns"),
        ({"discovery": [POOL], "routes": [{"model": "m", "backends": ["other-pool"]}]}, "routes.0.backends"),
    ],
)
def test_bad_discovery_config_fails_naming_the_field(doc: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings(doc)
    assert any(needle in line for line in info.value.errors), info.value.errors


def test_a_discovered_ipv6_backend_name_is_a_valid_backend_name() -> None:
    from gateway.discovery import DiscoveryEntry, Endpoint, backends_of
    from gateway.settings import Backend

    entry = DiscoveryEntry.model_validate({**POOL, "name": "p" * 40})
    (found,) = backends_of(entry, frozenset({Endpoint.of("fd00:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 65535)}))
    backend = Backend.model_validate(found.settings())
    assert backend.name == "p" * 40 + "-[fd00:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535"
    assert backend.base_url == "http://[fd00:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535"


def test_load_factor_is_prefix_affinitys_balance_knob() -> None:
    """`routes[].load_factor` reaches the route's prefix_affinity policy; elsewhere, or below 1, it is
    refused naming the field."""
    from gateway.routing import PrefixAffinity
    from gateway.routing.registry import POLICIES, policy_for

    doc = copy.deepcopy(BASE)
    doc["routes"][0] |= {"policy": "prefix_affinity", "load_factor": 1.5}
    route = parse_settings(doc).routes[0]
    policy = policy_for(route.policy, load_factor=route.load_factor)
    assert isinstance(policy, PrefixAffinity)
    assert (policy.load_factor, policy.holder_load_factor) == (1.5, 1.5)
    assert policy_for("prefix_affinity") is POLICIES["prefix_affinity"]
    for bad, needle in (({"policy": "least_load", "load_factor": 1.5}, "load_factor"),
                        ({"policy": "prefix_affinity", "load_factor": 0.9}, "routes.0.load_factor")):
        doc = copy.deepcopy(BASE)
        doc["routes"][0] |= bad
        with pytest.raises(ConfigError, match=needle):
            parse_settings(doc)
