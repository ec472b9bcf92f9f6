"""With CI set, any skip turns the run red (tests/ci.py); without it, skips stay skips."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ci import message

pytest_plugins = ["pytester"]

CONFTEST = """
from tests.ci import (
    pytest_collectreport, pytest_configure, pytest_runtest_makereport, pytest_sessionfinish,
    pytest_terminal_summary,
)
"""
ROOT = Path(__file__).resolve().parents[2]
TESTS = """
import pytest

@pytest.fixture
def chromium():
    pytest.skip("chromium is not installed")

def test_runs():
    pass

def test_skips():
    pytest.skip("no dnsmasq here")

@pytest.mark.skipif(True, reason="marked")
def test_marked():
    pass

def test_needs_chromium(chromium):
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False
"""


def hooks(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    hooks(pytester)
    pytester.makepyfile(test_tier=TESTS)
    return pytester


def test_every_skip_fails_when_ci_is_set(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, failed=1, errors=2, xfailed=1)  # skips in setup (mark, fixture) are errors
    out = result.stdout.str()
    assert "skipped while CI is set (every tier must run in CI): no dnsmasq here" in out
    assert "chromium is not installed" in out
    assert "marked" in out


def test_skips_stay_skips_without_ci(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)


def test_a_module_skipped_at_collection_fails_the_session_in_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    hooks(pytester)
    pytester.makepyfile(test_gone='import pytest\npytest.skip("no prometheus", allow_module_level=True)\n',
                        test_here="def test_runs():\n    pass\n")
    monkeypatch.delenv("CI", raising=False)
    assert pytester.runpytest().ret == pytest.ExitCode.OK
    monkeypatch.setenv("CI", "1")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*skipped at collection while CI is set*", "*test_gone.py*no prometheus*"])


def test_skips_fail_the_run_under_xdist_too(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make test` runs pytest-xdist: the workers' skips reach the controller, which fails the run."""
    hooks(pytester)
    pytester.makepyfile(test_gone='import pytest\npytest.skip("no prometheus", allow_module_level=True)\n',
                        test_tier=TESTS)
    monkeypatch.setenv("CI", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = pytester.runpytest_subprocess("-n", "2", "-p", "xdist")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, failed=1, errors=2, xfailed=1, skipped=1)  # the module's skip, listed
    result.stdout.fnmatch_lines(["*skipped at collection while CI is set*", "*test_gone.py*no prometheus*"])
    assert "no dnsmasq here" in result.stdout.str()


@pytest.mark.parametrize(("nodeid", "need"), [
    ("tests/browser/test_dashboard.py::test_x", "chromium"),
    ("tests/discovery/test_dns.py::test_x", "dnsmasq"),
    ("tests/prometheus/test_scrape.py::test_x", "prometheus and promtool"),
    ("tests/real/test_real_vllm.py::test_x", "the real vLLM environment"),
])
def test_the_message_names_what_the_tier_needs(nodeid: str, need: str) -> None:
    assert f"this tier needs {need}" in message(nodeid, "reason")
    assert message(nodeid, "reason").endswith(": reason")
