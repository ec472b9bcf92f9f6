"""Hooks for every tier: with `CI` set, a skipped test fails the run (`tests/ci.py`).

Warnings are errors (pyproject.toml). One exception, for the tiers whose gateway runs as a separate
process (integration, conformance, fuzz, discovery, replicas, Prometheus, browser, real): there the
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

import pytest

from tests.ci import (
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

__all__ = ["pytest_collection_modifyitems", "pytest_make_collect_report", "pytest_runtest_makereport",
           "pytest_sessionfinish", "pytest_terminal_summary", "sweep_test_doubles"]

OUT_OF_PROCESS = frozenset({"integration", "conformance", "fuzz", "discovery", "replicas", "prometheus",
                            "browser", "real"})
TESTS = Path(__file__).parent


def _tier(path: Path) -> str:
    try:
        return path.relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return ""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _tier(item.path) in OUT_OF_PROCESS:
            item.add_marker(pytest.mark.filterwarnings("ignore::ResourceWarning"))


@pytest.fixture(scope="module", autouse=True)
def sweep_test_doubles(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if _tier(request.path) in OUT_OF_PROCESS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
