"""promtool: the shipped config and rules are valid, and every rule has a unit test that passes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .tools import PROMETHEUS_DIR, binaries, rule_groups

RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
TEST_FILES = sorted((PROMETHEUS_DIR / "tests").glob("*.test.yml"))


@pytest.fixture(scope="module")
def promtool() -> Path:
    return binaries() / "promtool"


def run(promtool: Path, *args: str) -> str:
    done = subprocess.run([str(promtool), *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_rule_files_pass_promtool_check(promtool: Path) -> None:
    out = run(promtool, "check", "rules", *(str(p) for p in RULE_FILES))
    assert out.count("SUCCESS") == len(RULE_FILES) == 2


def test_the_example_config_passes_promtool_check_and_loads_every_rule_file(promtool: Path) -> None:
    out = run(promtool, "check", "config", "prometheus.yml")
    assert "is valid prometheus config file syntax" in out
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert sorted(PROMETHEUS_DIR / f for f in config["rule_files"]) == RULE_FILES


def test_rule_unit_tests_pass(promtool: Path) -> None:
    out = run(promtool, "test", "rules", *(str(p) for p in TEST_FILES))
    assert out.count("SUCCESS") == len(TEST_FILES) >= 3
    assert "FAILED" not in out


def unit_tests() -> list[dict[str, Any]]:
    return [t for path in TEST_FILES for t in yaml.safe_load(path.read_text())["tests"]]


def test_every_recording_rule_is_checked_by_a_unit_test() -> None:
    tested = " ".join(str(e["expr"]) for t in unit_tests() for e in t.get("promql_expr_test", []))
    records = {r["record"] for g in rule_groups("gateway-recording.yml") for r in g["rules"]}
    untested = sorted(r for r in records if not re.search(rf"(?<![\w:]){re.escape(r)}(?![\w:])", tested))
    assert not untested


def test_every_alert_has_a_unit_test_where_it_fires() -> None:
    fired = {a["alertname"] for t in unit_tests() for a in t.get("alert_rule_test", []) if a["exp_alerts"]}
    alerts = {r["alert"] for g in rule_groups("gateway-alerts.yml") for r in g["rules"]}
    assert len(alerts) >= 8
    assert alerts <= fired, sorted(alerts - fired)
