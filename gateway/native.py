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


def _extensions() -> list[Path]:
    return [so for package in _PACKAGES for so in (_ROOT / package).rglob("*.so")]


def compiled() -> list[str]:
    """Sources that have a compiled module beside them, relative to the project root."""
    sources = (so.with_name(so.name.split(".", 1)[0] + ".py") for so in _extensions())
    return sorted(str(source.relative_to(_ROOT)) for source in sources if source.exists())


def stale() -> list[str]:
    """Sources edited after their compiled module was built, relative to the project root."""
    out = []
    for so in _extensions():
        source = so.with_name(so.name.split(".", 1)[0] + ".py")
        if source.exists() and source.stat().st_mtime > so.stat().st_mtime:
            out.append(str(source.relative_to(_ROOT)))
    return sorted(out)


def check() -> None:
    if names := stale():
        raise StaleNativeBuild(
            f"compiled modules are older than their sources ({', '.join(names)}): run `make native` to "
            "rebuild them, or `make pure` to remove them and run the pure-Python sources"
        )


def describe() -> str:
    """'native (mypyc): N modules' or 'pure Python', from what was actually imported."""
    compiled = [
        name for name, module in list(sys.modules.items())
        if name.split(".", 1)[0] in _PACKAGES and (getattr(module, "__file__", None) or "").endswith(".so")
    ]
    return f"native (mypyc): {len(compiled)} modules" if compiled else "pure Python"
