"""deploy/README.md shows what the tests run: the container tier's podman commands and an
`kubectl apply -k` for every kustomization."""

from __future__ import annotations

import re
import shlex

from tests.container.podman import build_command, healthcheck_command, remove_command, run_command

from .manifests import K8S_VERSION, ROOT, kustomizations

README = ROOT / "deploy" / "README.md"
IMAGE = "localhost/inference-gateway"  # the README's tag: the one the kustomize base names
NAME = "gateway"


def commands_in(path: str) -> str:
    """The file's text with shell line continuations joined, as a shell would read the commands."""
    return re.sub(r"[ \t]*\\\n[ \t]*", " ", (ROOT / path).read_text(encoding="utf-8"))


def test_the_deploy_readme_shows_the_podman_commands_the_container_tier_runs() -> None:
    text = commands_in("deploy/README.md")
    expected = [
        "scripts/container/base_image.sh",
        shlex.join(build_command(tag=IMAGE)),
        shlex.join(run_command(name=NAME, port=8080, image=IMAGE)),
        shlex.join(healthcheck_command(NAME)),
        shlex.join(remove_command(NAME)),
    ]
    assert [command for command in expected if command not in text] == []


def test_the_deploy_readme_applies_every_kustomization() -> None:
    text = commands_in("deploy/README.md")
    assert [k for k in kustomizations() if f"kubectl apply -k deploy/kubernetes/{k} " not in text] == []
    assert f"kubernetes-validate --strict -k {K8S_VERSION}" in text


def test_the_readme_points_at_the_deploy_guide() -> None:
    text = commands_in("README.md")
    assert "deploy/README.md" in text
    assert "make test-container" in text
