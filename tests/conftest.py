"""Hooks for every tier: with `CI` set, a skipped test fails the run (`tests/ci.py`).

Warnings are errors (pyproject.toml). One exception, for the tiers whose gateway runs as a separate
process (integration, conformance, fuzz, discovery, replicas, Prometheus, browser, real, envoy): there the
test process holds only test doubles and clients (emulators on a loop thread, raw sockets), and a
socket of theirs that the garbage collector finds unclosed would fail whichever test happens to be
running when it collects, in any tier, later. So in those tiers `ResourceWarning` is ignored, and each
module ends with a collection, so nothing of theirs is left for the in-process tiers (unit,
emulator), where an unclosed socket is the gateway's own and stays an error.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ci import (
    pytest_collectreport,
    pytest_configure,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

__all__ = ["pytest_collection_modifyitems", "pytest_collectreport", "pytest_configure", "pytest_runtest_makereport",
           "pytest_sessionfinish", "pytest_terminal_summary", "sweep_test_doubles"]

OUT_OF_PROCESS = frozenset({"integration", "conformance", "fuzz", "discovery", "replicas", "prometheus",
                            "browser", "real", "envoy"})
TESTS = Path(__file__).parent
# Under pytest-xdist (`make test` runs `--dist loadscope`) a module runs whole on one worker (its
# module-scoped servers start once); these tiers run whole on one worker each, because their
# session-scoped servers (real vLLM, Prometheus, Chromium, the conformance and fuzz fleets) are
# expensive and would start once per worker otherwise.
ONE_WORKER = frozenset({"real", "prometheus", "browser", "conformance", "fuzz", "container"})


def _tier(path: Path) -> str:
    try:
        return path.relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return ""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _tier(item.path) in OUT_OF_PROCESS:
            item.add_marker(pytest.mark.filterwarnings("ignore::ResourceWarning"))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `--dist loadscope` (what `make test` runs), a scope is sent whole to one worker: here a
    test module, or, for the tiers in `ONE_WORKER`, the whole tier. Other modes: xdist's own."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByTier(LoadScopeScheduling):  # type: ignore[misc]  # (xdist is untyped)
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            parts = module.split("/")
            return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in ONE_WORKER else module

    return ByTier(config, log)


@pytest.fixture(scope="module", autouse=True)
def sweep_test_doubles(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if _tier(request.path) in OUT_OF_PROCESS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
