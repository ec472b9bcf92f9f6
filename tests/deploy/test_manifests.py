"""deploy/kubernetes: every kustomization renders and validates against the Kubernetes schemas, and
what it renders fits together (probes, users, selectors, RBAC, the config the gateway will read)."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml

from gateway.settings import ConfigError, parse_settings

from .manifests import (
    ROOT,
    Resource,
    find,
    kustomizations,
    of_kind,
    render,
    selects,
    split_custom,
    validate,
    validate_custom,
)

GATEWAY = "inference-gateway"
NAMESPACE = "inference-gateway"
ALL = kustomizations()
REDIS_URL = "redis://redis:6379/0"


def dockerfile_uid() -> int:
    match = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert match, "the Dockerfile names its user by number (USER uid:gid), as runAsNonRoot needs"
    return int(match.group(1))


def gateway_container(resources: list[Resource]) -> dict[str, Any]:
    pod = find(resources, "Deployment", GATEWAY)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return dict(container)


def gateway_config(resources: list[Resource]) -> dict[str, Any]:
    """The config file the gateway reads: the ConfigMap behind the volume mounted where --config points."""
    pod = find(resources, "Deployment", GATEWAY)["spec"]["template"]["spec"]
    container = gateway_container(resources)
    args = container["args"]
    path = PurePosixPath(args[args.index("--config") + 1])
    (mount,) = [m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == path.parent]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = find(resources, "ConfigMap", volume["configMap"]["name"])
    data: dict[str, Any] = yaml.safe_load(config_map["data"][path.name])
    return data


def refusals(config: dict[str, Any]) -> list[str]:
    """What the gateway's own validation says about a config: one line per problem, none if it loads."""
    try:
        parse_settings(config)
    except ConfigError as exc:
        return exc.errors
    return []


def test_the_expected_kustomizations_exist() -> None:
    assert {"base", "overlays/redis", "overlays/prometheus", "overlays/discovery",
            "overlays/endpoint-picker"} <= set(ALL)


@pytest.mark.parametrize("kustomization", ALL)
def test_every_kustomization_renders_and_validates(kustomization: str) -> None:
    """Kubernetes' kinds by kubernetes-validate; a CRD's kinds (the InferencePool) by the vendored CRD."""
    builtin, custom = split_custom(render(kustomization))
    verdict = validate(yaml.safe_dump_all(builtin))
    assert verdict.ok, "\n".join(verdict.problems)
    assert verdict.passed == len(builtin) > 0  # every resource checked against a schema
    assert [problem for r in custom for problem in validate_custom(r)] == []


def test_the_validator_fails_unknown_fields_and_kinds_without_a_schema() -> None:
    """The check above can fail: an unknown field (strict schemas) and a kind with no schema (a CRD)."""
    deployment = find(render("base"), "Deployment", GATEWAY)
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    bad_field = validate(yaml.safe_dump(deployment))
    assert not bad_field.ok
    assert any("ERROR" in p for p in bad_field.problems)
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "gw"},
               "spec": {"selector": {}, "endpoints": [{"port": "http"}]}}
    no_schema = validate(yaml.safe_dump(monitor))
    assert no_schema.passed == 0
    assert not no_schema.ok
    assert any(p.startswith("WARN") for p in no_schema.problems)


@pytest.mark.parametrize("kustomization", ALL)
def test_every_namespaced_resource_lands_in_the_gateway_namespace(kustomization: str) -> None:
    resources = render(kustomization)
    assert [r["metadata"]["name"] for r in of_kind(resources, "Namespace")] == [NAMESPACE]
    elsewhere = [f"{r['kind']}/{r['metadata']['name']}" for r in resources
                 if r["kind"] != "Namespace" and r["metadata"].get("namespace") != NAMESPACE]
    assert elsewhere == []


@pytest.mark.parametrize("kustomization", ALL)
def test_the_gateway_is_probed_on_its_own_port(kustomization: str) -> None:
    container = gateway_container(render(kustomization))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    picker = {"grpc-picker": 9002} if kustomization == "overlays/endpoint-picker" else {}  # its ext_proc port
    assert ports == {"http": 8080, **picker}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("kustomization", ALL)
def test_every_pod_is_unprivileged_read_only_and_bounded(kustomization: str) -> None:
    deployments = of_kind(render(kustomization), "Deployment")
    assert deployments
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"] == {"drop": ["ALL"]}
            for bound in ("requests", "limits"):
                assert set(container["resources"][bound]) == {"cpu", "memory"}, (container["name"], bound)
    gateway_pod = find(deployments, "Deployment", GATEWAY)["spec"]["template"]["spec"]
    assert gateway_pod["securityContext"]["runAsUser"] == dockerfile_uid()
    writable = {m["mountPath"] for m in gateway_container(render(kustomization))["volumeMounts"]
                if not m.get("readOnly")}
    assert writable == {"/tmp"}  # the only path the gateway may write (a config copy with --workers)


@pytest.mark.parametrize("kustomization", ALL)
def test_service_budget_and_autoscaler_point_at_the_gateway(kustomization: str) -> None:
    resources = render(kustomization)
    labels = find(resources, "Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]
    service = find(resources, "Service", GATEWAY)["spec"]
    assert selects(service["selector"], labels)
    picker = {"grpc-picker"} if kustomization == "overlays/endpoint-picker" else set()
    assert {p["targetPort"] for p in service["ports"]} == {"http", *picker}
    for other in of_kind(resources, "Deployment"):
        if other["metadata"]["name"] != GATEWAY:
            assert not selects(service["selector"], other["spec"]["template"]["metadata"]["labels"])
    assert selects(find(resources, "PodDisruptionBudget", GATEWAY)["spec"]["selector"]["matchLabels"], labels)
    hpa = find(resources, "HorizontalPodAutoscaler", GATEWAY)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": GATEWAY}
    assert 1 < hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]  # the budget needs two to allow one out


@pytest.mark.parametrize("kustomization", ALL)
def test_the_gateway_may_read_endpoint_slices_and_pods(kustomization: str) -> None:
    resources = render(kustomization)
    account = find(resources, "Deployment", GATEWAY)["spec"]["template"]["spec"]["serviceAccountName"]
    find(resources, "ServiceAccount", account)
    (binding,) = [b for b in of_kind(resources, "RoleBinding")
                  if {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in b["subjects"]]
    role = find(resources, "Role", binding["roleRef"]["name"])
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    read = {"get", "list", "watch"}
    assert granted == {("discovery.k8s.io", "endpointslices", v) for v in read} | {("", "pods", v) for v in read}


@pytest.mark.parametrize("kustomization", ALL)
def test_the_config_map_holds_a_config_the_gateway_accepts(kustomization: str) -> None:
    resources = render(kustomization)
    settings = parse_settings(gateway_config(resources), source=f"{kustomization}/gateway.yaml")
    assert settings.listen.host == "0.0.0.0"  # reachable through the Service
    (http,) = [p for p in gateway_container(resources)["ports"] if p["name"] == "http"]
    assert settings.listen.port == http["containerPort"]


def test_the_redis_overlay_adds_shared_state_and_nothing_else() -> None:
    """The overlay's gateway.yaml is the base's plus `state.redis_url` at the overlay's Redis Service,
    and the gateway accepts it whole."""
    resources = render("overlays/redis")
    config = gateway_config(resources)
    assert refusals(config) == []
    state = parse_settings(config).state
    assert state is not None
    assert state.redis_url == REDIS_URL
    assert config.pop("state") == {"redis_url": REDIS_URL}
    assert config == gateway_config(render("base"))
    redis = find(resources, "Service", "redis")["spec"]
    pod = find(resources, "Deployment", "redis")["spec"]["template"]
    assert selects(redis["selector"], pod["metadata"]["labels"])
    (port,) = redis["ports"]
    assert port["port"] == 6379
    assert port["targetPort"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    policy = find(resources, "NetworkPolicy", "redis")["spec"]  # no password: only the gateway may connect
    assert selects(policy["podSelector"]["matchLabels"], pod["metadata"]["labels"])
    (rule,) = policy["ingress"]
    gateway_labels = find(resources, "Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]
    assert [selects(f["podSelector"]["matchLabels"], gateway_labels) for f in rule["from"]] == [True]
    assert [p["port"] for p in rule["ports"]] == [port["targetPort"]]


def test_the_prometheus_overlay_annotates_the_pods_for_scraping() -> None:
    resources = render("overlays/prometheus")
    annotations = find(resources, "Deployment", GATEWAY)["spec"]["template"]["metadata"]["annotations"]
    port = gateway_container(resources)["ports"][0]["containerPort"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                           "prometheus.io/path": "/metrics"}
    assert "annotations" not in find(render("base"), "Deployment", GATEWAY)["spec"]["template"]["metadata"]
    assert not [r for r in resources if r["apiVersion"].startswith("monitoring.coreos.com")]


def test_the_discovery_overlay_finds_every_backend_in_the_cluster_with_the_pods_own_account() -> None:
    """No static backends: pools by label selector and by a Service's EndpointSlices, in-cluster
    credentials, in the gateway's namespace (where the base's Role grants the reads)."""
    resources = render("overlays/discovery")
    settings = parse_settings(gateway_config(resources), source="overlays/discovery/gateway.yaml")
    assert settings.backends == []
    sources = {e.name: e.kubernetes for e in settings.discovery}
    assert all(k is not None and k.kubeconfig is None and k.namespace is None for k in sources.values())
    assert {k.label_selector is not None for k in sources.values() if k is not None} == {True, False}
    assert [r.candidates for r in settings.routes] == [list(sources)]
    pod = find(resources, "Deployment", GATEWAY)["spec"]["template"]["spec"]
    assert pod.get("automountServiceAccountToken", True) is True  # the in-cluster token is mounted
    base = gateway_config(render("base"))
    overlay = gateway_config(resources)
    assert {k: v for k, v in overlay.items() if k not in ("discovery", "routes")} == {
        k: v for k, v in base.items() if k not in ("backends", "routes")}


def test_the_inference_pool_schema_rejects_what_gie_rejects() -> None:
    """The vendored schema can fail: a pool without targetPorts, a port out of range, an unknown failure mode."""
    pool = find(render("overlays/endpoint-picker"), "InferencePool", "deepseek-v3")
    assert validate_custom(pool) == []
    for path, value in [(("spec", "targetPorts"), []), (("spec", "targetPorts"), [{"number": 70000}]),
                        (("spec", "endpointPickerRef", "failureMode"), "Sometimes")]:
        broken = yaml.safe_load(yaml.safe_dump(pool))
        broken[path[0]][path[1]] = value if len(path) == 2 else {**broken[path[0]][path[1]], path[2]: value}
        assert validate_custom(broken), path


def test_the_inference_pool_is_the_gateways_discovery_and_its_picker_is_the_gateway() -> None:
    resources = render("overlays/endpoint-picker")
    pool = find(resources, "InferencePool", "deepseek-v3")["spec"]
    config = gateway_config(resources)
    assert refusals(config) == []
    (entry,) = config["discovery"]
    labels = dict(kv.split("=", 1) for kv in entry["kubernetes"]["label_selector"].split(","))
    assert labels == pool["selector"]["matchLabels"]
    assert [p["number"] for p in pool["targetPorts"]] == [entry["kubernetes"]["port"]]
    ref = pool["endpointPickerRef"]
    assert ref["kind"] == "Service"  # GIE's CEL rule: a Service reference names its port
    service = find(resources, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    container = gateway_container(resources)
    (named,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    assert named["containerPort"] == config["endpoint_picker"]["listen"]["port"]
    assert config["endpoint_picker"]["listen"]["host"] == "0.0.0.0"
    assert ref["failureMode"] in {"FailClose", "FailOpen"}
