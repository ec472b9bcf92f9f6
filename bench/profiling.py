"""py-spy under load: a flame graph (SVG) and a collapsed-stack (raw) summary of where CPU goes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MARKERS = ("site-packages/", "lib/python3.11/", f"{Path(__file__).resolve().parents[1]}/")  # trimmed off paths


def py_spy() -> str | None:
    return shutil.which("py-spy") or next(
        (str(p) for p in [Path(sys.executable).parent / "py-spy"] if p.exists()), None)


def record(pid: int, out: Path, *, duration_s: int, fmt: str) -> subprocess.Popen[bytes] | None:
    """Start `py-spy record` on `pid` (returns the running recorder, or None without py-spy)."""
    exe = py_spy()
    if exe is None:
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(duration_s), "--rate", "200",
                             "--format", fmt, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@dataclass(frozen=True, slots=True)
class Summary:
    samples: int
    self_top: list[tuple[str, int]]  # leaf frames (where the CPU was spent)
    inclusive_top: list[tuple[str, int]]  # frames anywhere on the stack
    module_self: list[tuple[str, int]]  # self samples grouped by source file


def _frame(frame: str) -> str:
    # py-spy raw frames look like "function (path/to/file.py:123)"; keep function and short path.
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path, _, _line = where.rpartition(":")
    for marker in MARKERS:
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})" if path else name


def _module(frame: str) -> str:
    _, _, where = frame.partition(" (")
    path = where.rstrip(")").rpartition(":")[0]
    for marker in MARKERS:
        if marker in path:
            path = path.split(marker, 1)[1]
    return path or "<native>"


def summarise(raw: Path, top: int = 25) -> Summary:
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    mod: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = [f for f in stack.split(";") if f and not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        total += count
        self_c[_frame(frames[-1])] += count
        mod[_module(frames[-1])] += count
        for f in {_frame(f) for f in frames}:
            incl[f] += count
    return Summary(total, self_c.most_common(top), incl.most_common(top), mod.most_common(15))


def markdown(title: str, s: Summary) -> str:
    def table(rows: list[tuple[str, int]], head: str) -> list[str]:
        out = [f"| {head} | samples | % |", "|---|---:|---:|"]
        out += [f"| `{name}` | {n} | {100 * n / max(s.samples, 1):.1f} |" for name, n in rows]
        return out

    lines = [f"### {title}", "", f"{s.samples} CPU samples (idle excluded).", "",
             "**Self time by source file**", "", *table(s.module_self, "file"), "",
             "**Self time by frame (leaf)**", "", *table(s.self_top, "frame"), "",
             "**Inclusive (frame anywhere on the stack)**", "", *table(s.inclusive_top, "frame"), ""]
    return "\n".join(lines)
