"""The podman commands the container tier runs, built in one place.

deploy/README.md shows the same commands (`test_readme_shows_the_commands_this_tier_runs` renders
them with the README's values and looks for them there), so the documented way to build and run the
image is the one CI exercises. The settings are those these machines need: the `runc` runtime, limits
no higher than the host allows, the host network and CA bundle for pip during the build, and the
docker image format (the OCI format has no HEALTHCHECK; podman drops it silently).
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE_SCRIPT = ROOT / "scripts" / "container" / "base_image.sh"
PODMAN = ("podman", "--runtime", "/usr/sbin/runc")
LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
BASE_IMAGE = "localhost/debian-python:bookworm"
CONTAINER_PORT = 8080
UID = 10001  # the Dockerfile's unprivileged user


def build_command(*, tag: str, base: str = BASE_IMAGE, context: str = ".") -> list[str]:
    return [
        *PODMAN, "build", "--format", "docker", "--network", "host",
        "-v", "/etc/ssl/certs:/etc/ssl/certs:ro", *LIMITS,
        "--build-arg", f"BASE={base}", "-t", tag, context,
    ]  # fmt: skip


def run_command(*, name: str, port: int, image: str) -> list[str]:
    return [*PODMAN, "run", "--detach", "--name", name, *LIMITS, "-p", f"127.0.0.1:{port}:{CONTAINER_PORT}", image]


def healthcheck_command(name: str) -> list[str]:
    return [*PODMAN, "healthcheck", "run", name]


def remove_command(name: str) -> list[str]:
    return [*PODMAN, "rm", "--force", "--time", "5", name]


def podman(*args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one podman subcommand; on failure (with `check`) the error carries its output."""
    return run([*PODMAN, *args], timeout=timeout, check=check)


def run(argv: Sequence[str], *, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"`{shlex.join(argv)}` exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    return result
