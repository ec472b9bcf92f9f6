"""Which build runs: pure Python, or the request path compiled by mypyc (`make native`, `setup.py`).

Compiled modules sit beside their sources as C extensions, and Python imports an extension before a
`.py` of the same name. An extension older than its source would silently run old code, so importing
the gateway refuses one (`check`), naming the fix.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = ("gateway", "backends")


class StaleNativeBuild(ImportError):
    pass


def _pairs(root: Path) -> list[tuple[Path, Path]]:
    """(compiled module, its source: Python for mypyc's, C for a C extension) under `root`'s
    packages; the shared library has no source."""
    pairs = []
    for package in _PACKAGES:
        for so in (root / package).rglob("*.so"):
            stem = so.name.split(".", 1)[0]
            for source in (so.with_name(stem + ".py"), so.with_name(stem + ".c")):  # mypyc's, or written in C
                if source.exists():
                    pairs.append((so, source))
                    break
    return pairs


def compiled(root: Path = _ROOT) -> list[str]:
    """Sources that have a compiled module beside them, relative to `root`."""
    return sorted(str(source.relative_to(root)) for _, source in _pairs(root))


def stale(root: Path = _ROOT) -> list[str]:
    """Sources edited after their compiled module was built, relative to `root` (a C extension's are
    every C source and header beside it: it may be built from several)."""
    names: set[str] = set()
    for so, source in _pairs(root):
        sources = [source] if source.suffix == ".py" else [*source.parent.glob("*.c"), *source.parent.glob("*.h")]
        names.update(str(s.relative_to(root)) for s in sources if s.stat().st_mtime > so.stat().st_mtime)
    return sorted(names)


def check(root: Path = _ROOT) -> None:
    """In a source checkout (where `make native` builds in place), refuse stale compiled modules. An
    installed wheel is built once and its files carry installation times, so it is not checked."""
    if not (root / "setup.py").exists():
        return
    if names := stale(root):
        raise StaleNativeBuild(
            f"compiled modules are older than their sources ({', '.join(names)}): run `make native` to "
            "rebuild them, or `make pure` to remove them and run the pure-Python sources"
        )


C_MODULES = ("gateway.proxy._sse_scan",)  # written in C (setup.py's C_EXTENSIONS), the rest by mypyc


def describe() -> str:
    """'native (mypyc): N modules, C: …' or 'pure Python', from what was actually imported."""
    compiled = [
        name for name, module in list(sys.modules.items())
        if name.split(".", 1)[0] in _PACKAGES and not name.endswith("__mypyc")  # (the shared library)
        and (getattr(module, "__file__", None) or "").endswith(".so")
    ]
    if not compiled:
        return "pure Python"
    c = [name for name in compiled if name in C_MODULES]
    return f"native (mypyc): {len(compiled) - len(c)} modules" + (f", C: {', '.join(sorted(c))}" if c else "")
