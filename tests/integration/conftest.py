from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .fixtures import emulators, loop_thread
from .harness import GatewayProcess

__all__ = ["emulators", "loop_thread"]


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    started: list[GatewayProcess] = []

    def start(backends: list[dict[str, Any]], routes: list[dict[str, Any]] | None = None, *,
              host: str = "127.0.0.1", workers: int = 1, env: dict[str, str] | None = None,
              **extra: Any) -> GatewayProcess:
        config: dict[str, Any] = {
            "backends": backends,
            "routes": routes or [{"model": "moe", "backends": [b["name"] for b in backends],
                                  "policy": "round_robin"}],
            "health": {"interval_s": 0.2, "failure_threshold": 2, "cooldown_s": 0.5},
            **extra,
        }
        workdir = tmp_path / f"gw{len(started)}"
        workdir.mkdir()
        gw = GatewayProcess(config, workdir, host=host, workers=workers, env=env)
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()
