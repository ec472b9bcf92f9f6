"""The guard against compiled modules older than their sources (`make native` builds in place)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.build_check import StaleNativeBuild, check, compiled, stale

SUFFIX = ".cpython-311-x86_64-linux-gnu.so"


def checkout(tmp_path: Path) -> Path:
    (tmp_path / "setup.py").write_text("")
    for rel in ("gateway/proxy.py", "gateway/routing/sla.py", "backends/vllm.py", "gateway/settings.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    for rel in ("gateway/proxy", "gateway/routing/sla", "backends/vllm", "gateway/_native__mypyc"):
        (tmp_path / f"{rel}{SUFFIX}").write_bytes(b"")
    return tmp_path


def age(path: Path, seconds: float) -> None:
    t = path.stat().st_mtime - seconds
    os.utime(path, (t, t))


def test_a_fresh_build_passes_and_lists_its_modules(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    for source in ("gateway/proxy.py", "gateway/routing/sla.py", "backends/vllm.py"):
        age(root / source, 10)
    assert compiled(root) == ["backends/vllm.py", "gateway/proxy.py", "gateway/routing/sla.py"]
    assert stale(root) == []
    check(root)


def test_a_source_edited_after_the_build_is_refused_with_the_fix(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    for so in root.rglob("*.so"):
        age(so, 10)
    age(root / "backends/vllm.py", 20)  # older than its build: fine
    assert stale(root) == ["gateway/proxy.py", "gateway/routing/sla.py"]
    with pytest.raises(StaleNativeBuild, match=r"gateway/proxy\.py.*make native.*make pure"):
        check(root)


def test_an_installed_wheel_is_not_checked(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    (root / "setup.py").unlink()  # site-packages: no checkout around the packages
    for so in root.rglob("*.so"):
        age(so, 10)
    assert stale(root)
    check(root)


def test_a_c_extension_is_stale_when_any_c_source_or_header_beside_it_is_newer(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    for rel in ("gateway/proxy/_scan.c", "gateway/proxy/_facts.c", "gateway/proxy/_facts.h"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
        age(root / rel, 20)
    (root / f"gateway/proxy/_scan{SUFFIX}").write_bytes(b"")
    for source in root.rglob("*.py"):
        age(source, 20)
    for so in root.rglob("*.so"):
        age(so, 10)
    assert "gateway/proxy/_scan.c" in compiled(root)
    assert stale(root) == []
    age(root / "gateway/proxy/_facts.h", -30)  # a header edited after the build
    assert stale(root) == ["gateway/proxy/_facts.h"]
