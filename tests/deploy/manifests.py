"""Render the kustomizations with `kubectl kustomize` and validate them with `kubernetes-validate`.

kubectl is a system tool (these machines ship 1.32 with kustomize v5); kubernetes-validate is a dev
dependency. Its "no schema" warning (a kind it does not know, such as a CRD) counts as a failure here:
every resource we ship must be checked against the Kubernetes schemas, or it is not validated at all.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
# The newest Kubernetes release whose schemas kubernetes-validate ships (1.37.0 in its 1.37.x
# releases, the floor pyproject.toml sets): `--strict` uses the schemas that reject unknown fields.
K8S_VERSION = "1.37.0"

Resource = dict[str, Any]


def kustomizations() -> list[str]:
    """Every directory under deploy/kubernetes with a kustomization, relative to it (a new overlay is
    tested without being listed anywhere)."""
    return sorted(str(p.parent.relative_to(KUBERNETES)) for p in KUBERNETES.rglob("kustomization.yaml"))


def kubectl() -> str:
    """kubectl's path; without it the manifests cannot be rendered: a failure in CI, a skip elsewhere."""
    path = shutil.which("kubectl")
    if path is None:
        message = "kubectl (with kustomize v5) is not on PATH: the manifests cannot be rendered"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return path


@functools.cache
def render_text(kustomization: str) -> str:
    result = subprocess.run(
        [kubectl(), "kustomize", str(KUBERNETES / kustomization)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {kustomization} failed:\n{result.stderr}")
    return result.stdout


def render(kustomization: str) -> list[Resource]:
    return [doc for doc in yaml.safe_load_all(render_text(kustomization)) if doc]


@dataclass(frozen=True, slots=True)
class Verdict:
    passed: int  # resources validated against a schema
    problems: list[str]  # every line that is not a pass: ERROR, WARN (no schema), FATAL
    returncode: int

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.problems


def validate(manifests: str) -> Verdict:
    """kubernetes-validate --strict against K8S_VERSION, reading the manifests from stdin."""
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSION, "-"],
        input=manifests, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    passed = [line for line in lines if line.startswith("INFO") and " passed for resource " in line]
    return Verdict(passed=len(passed), problems=[line for line in lines if line not in passed],
                   returncode=result.returncode)


CRDS = Path(__file__).parent / "crds"  # vendored CRDs (their files say from where): schemas for kinds Kubernetes lacks


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the openAPIV3Schema of every served version of the vendored CRDs."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                out[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return out


def validate_custom(resource: Resource) -> list[str]:
    """A custom resource against its vendored CRD's schema (structural OpenAPI v3, checked as JSON
    Schema; `x-kubernetes-*` extensions and CEL rules are left to the tests that need them)."""
    import jsonschema_rs

    schema = crd_schemas()[(resource["apiVersion"], resource["kind"])]
    return [f"{resource['kind']}/{resource['metadata']['name']}: {e.message} at {list(e.instance_path)}"
            for e in jsonschema_rs.validator_for(schema).iter_errors(resource)]


def split_custom(resources: list[Resource]) -> tuple[list[Resource], list[Resource]]:
    """(resources Kubernetes has schemas for, resources of a vendored CRD's kinds)."""
    custom = [r for r in resources if (r["apiVersion"], r["kind"]) in crd_schemas()]
    return [r for r in resources if r not in custom], custom


def find(resources: list[Resource], kind: str, name: str) -> Resource:
    matches = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def of_kind(resources: list[Resource], kind: str) -> list[Resource]:
    return [r for r in resources if r["kind"] == kind]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
