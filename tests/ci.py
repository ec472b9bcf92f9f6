"""The CI rule: with the environment variable `CI` set, a skipped test is a failure.

Locally a tier whose tools are missing (chromium, dnsmasq, prometheus, the real vLLM environment)
skips with a reason; in CI a skip would hide a tier that never ran, so every skip turns the run red
with a message naming what is missing and how `make test` provides it. A test skipped at run time
(a `skip`/`skipif` mark, `pytest.skip` in a fixture or the test) is reported as failed (an error
when it happened in setup); a whole module skipped at collection is listed at the end and fails the
session. Expected failures (`xfail`) are not skips. The hooks are installed by tests/conftest.py.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

# What each tier needs, by its directory under tests/ (the skip's own reason is added to this).
NEEDS = {
    "browser": "chromium (`make system-deps`)",
    "discovery": "dnsmasq (`make system-deps`)",
    "prometheus": "prometheus and promtool (`make prometheus`)",
    "real": "the real vLLM environment (`make real-env`)",
    "replicas": "redis-server (`make system-deps`)",
}
COLLECTION_SKIPS = pytest.StashKey[list[str]]()


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def message(nodeid: str, reason: str) -> str:
    """Why `nodeid` must not skip in CI, naming what its tier needs."""
    parts = nodeid.split("/")
    need = NEEDS.get(parts[1]) if len(parts) > 2 and parts[0] == "tests" else None
    needs = f"; this tier needs {need}" if need else ""
    return f"skipped while CI is set (every tier must run in CI){needs}: {reason}"


def _is_skip(report: pytest.CollectReport | pytest.TestReport) -> bool:
    return report.skipped and not hasattr(report, "wasxfail")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if in_ci() and _is_skip(report):
        report.outcome = "failed"
        report.longrepr = message(report.nodeid, _reason(report))


_CONFIG: list[pytest.Config] = []  # the session's config (`pytest_collectreport` is given none)


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG[:] = [config]


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """Collection skips, remembered for the summary. Under pytest-xdist the controller is given the
    workers' skipped and failed collection reports through this same hook, so a module skipped on a
    worker is listed and fails the session there too."""
    if in_ci() and _is_skip(report) and _CONFIG:
        skips = _CONFIG[0].stash.setdefault(COLLECTION_SKIPS, [])
        line = f"{report.nodeid}: {message(report.nodeid, _reason(report))}"
        if line not in skips:
            skips.append(line)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    skips = config.stash.get(COLLECTION_SKIPS, [])
    if skips:
        terminalreporter.section("skipped at collection while CI is set", sep="=", red=True)
        for line in skips:
            terminalreporter.line(line, red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.stash.get(COLLECTION_SKIPS, []) and exitstatus in (
        pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED
    ):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
