"""Fixtures for the container tier: the image, built for real with podman, and one running container.

The base image is made without a registry (scripts/container/base_image.sh: debootstrap, cached in
${IGW_CACHE:-~/.cache/igw}); the build then reuses podman's layer cache, so a rerun with unchanged
sources takes seconds. Every container a test starts is removed by name in a `finally`, whatever
happened. Missing tools fail the tier (they are installed by `make container-deps`), never skip it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from .podman import BASE_IMAGE_SCRIPT, build_command, podman, remove_command, run, run_command

IMAGE = "localhost/inference-gateway:test"
BASE_TIMEOUT_S = 900.0  # debootstrap: 1-4 min on a busy 2-core machine
BUILD_TIMEOUT_S = 1500.0  # uncached: 3-5 min (pip downloads, mypyc compiles ~36 modules)
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Container:
    name: str
    url: str  # the published port on loopback, http://127.0.0.1:PORT


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def unique_name(role: str) -> str:
    return f"igw-test-{role}-{os.getpid()}-{secrets.token_hex(3)}"


def _require_tools() -> None:
    missing = [tool for tool in ("podman", "/usr/sbin/runc", "debootstrap") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the container tier needs {', '.join(missing)}: run `make container-deps` (Debian, as root)",
                    pytrace=False)


@pytest.fixture(scope="session")
def image() -> str:
    """Build the image from the checkout on the locally made Debian base; return its tag."""
    _require_tools()
    t0 = time.monotonic()
    base = run(["bash", str(BASE_IMAGE_SCRIPT)], timeout=BASE_TIMEOUT_S).stdout.strip().splitlines()[-1]
    t1 = time.monotonic()
    run(build_command(tag=IMAGE, base=base), timeout=BUILD_TIMEOUT_S)
    print(f"\n[container] base image {t1 - t0:.1f} s, image build {time.monotonic() - t1:.1f} s", file=sys.stderr)
    return IMAGE


def _state(name: str) -> str:
    return podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout.strip()


def wait_ready(name: str, url: str) -> None:
    """Poll /ready until the demo fleet is healthy; fail at once (with the logs) if the container exits."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        state = _state(name)
        if state != "running" or time.monotonic() > deadline:
            logs = podman("logs", name, check=False)
            pytest.fail(f"container {name} not ready (state {state!r}):\n{logs.stdout[-3000:]}\n{logs.stderr[-3000:]}",
                        pytrace=False)
        time.sleep(0.25)


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[Container]:
    """The image's default command (the embedded demo fleet) with its port published on loopback."""
    name = unique_name("demo")
    port = free_port()
    try:
        run(run_command(name=name, port=port, image=image), timeout=120)
        url = f"http://127.0.0.1:{port}"
        wait_ready(name, url)
        yield Container(name=name, url=url)
    finally:
        run(remove_command(name), timeout=60, check=False)
