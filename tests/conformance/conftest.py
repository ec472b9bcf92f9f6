"""One gateway process per front (`listen.front: native` and `aiohttp`), each in front of a fast and
a slow emulator, shared by the suite's tests; limits are small and timeouts short to keep it fast."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from backends.emulator import RunningEmulator
from tests.integration.harness import Emulators, GatewayProcess, LoopThread, backend_entry

MAX_BODY, MAX_LINE, MAX_HEAD = 4096, 1024, 2048
HEADER_TIMEOUT_S = BODY_TIMEOUT_S = 0.5
LIMITS: dict[str, float] = {
    "max_body_bytes": MAX_BODY, "max_header_bytes": MAX_LINE, "max_header_section_bytes": MAX_HEAD,
    "header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S,
}
FRONTS = ["native", "aiohttp"]


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def emulators(loop_thread: LoopThread) -> Iterator[Emulators]:
    emus = Emulators(loop_thread)
    yield emus
    emus.stop_all()


@dataclass
class Fleet:
    fast: RunningEmulator  # model "moe"
    slow: RunningEmulator  # model "slow": a long answer takes seconds

    def entries(self) -> list[dict[str, Any]]:
        return [backend_entry("fast", self.fast, "vllm"), backend_entry("slow", self.slow, "vllm")]


@pytest.fixture(scope="session")
def fleet(emulators: Emulators) -> Fleet:
    return Fleet(emulators.start("vllm"), emulators.start("vllm", speed=1.0, profile="deepseek-v3-8xh200"))


@pytest.fixture(scope="module", params=FRONTS)
def gw(
    request: pytest.FixtureRequest, fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    front = request.param
    config = {
        "listen": {"front": front},
        "backends": fleet.entries(),
        "routes": [{"model": "moe", "backends": ["fast"]}, {"model": "slow", "backends": ["slow"]}],
        "limits": LIMITS,
    }
    workdir: Path = tmp_path_factory.mktemp(f"gw-{front}")
    gateway = GatewayProcess(config, workdir)
    yield gateway
    gateway.stop()
