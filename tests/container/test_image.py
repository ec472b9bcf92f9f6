"""The container image, built and run for real: SDK answers through the published port, the
healthcheck, the unprivileged user, and a runtime stage with nothing to build with."""

from __future__ import annotations

import json

import openai
import pytest

from .conftest import Container, unique_name
from .podman import UID, healthcheck_command, podman, remove_command, run

pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]  # the first test's setup builds the image

MODEL = "deepseek-v3"  # the embedded demo fleet's route

# Run by the image's own interpreter: what in the runtime stage could build or install anything.
PROBE = r"""
import importlib.util, json, os, re, sysconfig
compiler = re.compile(r"^(?:[\w.]+-)?(?:gcc|g\+\+|c\+\+|cc|cpp|clang|ld|as|make)(?:-[\d.]+)?$")
tools = sorted({
    os.path.join(d, f)
    for d in os.environ["PATH"].split(":") + ["/usr/bin", "/usr/sbin", "/usr/local/bin"] if os.path.isdir(d)
    for f in os.listdir(d) if compiler.match(f)
})
with open("/var/lib/dpkg/status") as f:
    installed = {
        m["name"] for m in (re.search(r"^Package: (?P<name>\S+)", s, re.M) for s in f.read().split("\n\n")
                            if "Status: install ok installed" in s) if m
    }
build_packages = sorted(p for p in installed
                        if re.match(r"^(gcc|g\+\+|cpp|binutils|make|libc6-dev|build-essential)(-[\d.]+)?$", p)
                        or p.endswith("-dev"))
print(json.dumps({
    "tools": tools,
    "build_packages": build_packages,
    "python_headers": os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
    "modules": [m for m in ("pip", "setuptools", "wheel", "mypy", "mypyc") if importlib.util.find_spec(m)],
}))
"""


def client(container: Container) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{container.url}/v1", api_key="unused", max_retries=0, timeout=30.0)


def test_the_demo_fleet_answers_a_chat_through_the_published_port(container: Container) -> None:
    sdk = client(container)
    assert MODEL in {m.id for m in sdk.models.list()}
    reply = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Which runtime served me?"}], max_tokens=16
    )
    assert reply.choices[0].message.content
    assert reply.choices[0].message.content.strip()
    assert reply.usage is not None
    assert reply.usage.completion_tokens > 0


def test_the_demo_fleet_streams_an_answer(container: Container) -> None:
    stream = client(container).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream to me."}], max_tokens=16, stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = [], [], None
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.finish_reason:
                finish.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert "".join(text).strip()
    assert len(finish) == 1
    assert usage is not None
    assert usage.completion_tokens > 0


def test_the_healthcheck_passes_on_a_serving_gateway(container: Container, image: str) -> None:
    check = json.loads(podman("image", "inspect", "--format", "{{json .Config.Healthcheck}}", image).stdout)
    assert check["Test"][:2] == ["CMD", "/opt/gateway/bin/python"]  # survived the build (docker format)
    assert run(healthcheck_command(container.name), timeout=30, check=False).returncode == 0
    assert podman("inspect", "--format", "{{.State.Health.Status}}", container.name).stdout.strip() == "healthy"


def test_the_healthcheck_fails_when_nothing_answers(image: str) -> None:
    name = unique_name("idle")
    try:  # the image's interpreter idling in place of the gateway: the check must say so
        podman("run", "--detach", "--name", name, "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
               "--entrypoint", "/opt/gateway/bin/python", image, "-c", "import time; time.sleep(300)")
        result = run(healthcheck_command(name), timeout=30, check=False)
        assert result.returncode == 1
        assert "unhealthy" in result.stdout
    finally:
        run(remove_command(name), timeout=60, check=False)


def test_the_gateway_runs_as_the_unprivileged_user(container: Container, image: str) -> None:
    assert podman("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip() == f"{UID}:{UID}"
    status = podman("exec", container.name, "cat", "/proc/1/status").stdout  # PID 1 is the gateway itself
    ids = {line.split(":")[0]: line.split()[1:] for line in status.splitlines() if line.startswith(("Uid:", "Gid:"))}
    assert ids == {"Uid": [str(UID)] * 4, "Gid": [str(UID)] * 4}


def test_the_runtime_stage_holds_nothing_to_build_with(container: Container) -> None:
    found = json.loads(podman("exec", container.name, "/opt/gateway/bin/python", "-c", PROBE).stdout)
    assert found == {"tools": [], "build_packages": [], "python_headers": False, "modules": []}


def test_the_image_runs_the_compiled_request_path(container: Container) -> None:
    logs = podman("logs", container.name)
    assert "build: native (mypyc)" in logs.stdout + logs.stderr
