"""Hooks for every tier: with `CI` set, a skipped test fails the run (`tests/ci.py`)."""

from tests.ci import (
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

__all__ = ["pytest_make_collect_report", "pytest_runtest_makereport", "pytest_sessionfinish",
           "pytest_terminal_summary"]
