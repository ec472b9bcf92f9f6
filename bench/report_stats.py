"""The arithmetic of `bench overhead`'s report: the wrk rows of a run looked up by part, target and
round; medians over rounds; ratios and differences taken within a round (the targets were measured
one after the other in it), then their median. And the few ways figures are printed."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from bench.targets import ORDER


def med(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def fmt(v: float | None, fmt: str = ".1f") -> str:
    return "–" if v is None else format(v, fmt)


def times(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def order(name: str) -> int:
    return ORDER.index(name) if name in ORDER else len(ORDER)


def group(rows: list[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    out: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


class Points:
    """The wrk rows of one run, looked up by section, concurrency, target and round."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def of(self, section: str, target: str, c: int | None = None) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["section"] == section and r["target"] == target
                and (c is None or r["c"] == c)]

    def targets(self, section: str) -> list[str]:
        return sorted({r["target"] for r in self.rows if r["section"] == section}, key=order)

    def med(self, section: str, target: str, key: str, c: int | None = None) -> float | None:
        return med(r.get(key) for r in self.of(section, target, c))

    def paired(self, section: str, a: str, b: str, c: int | None = None) -> list[tuple[dict[str, Any],
                                                                                        dict[str, Any]]]:
        mine = {r["round"]: r for r in self.of(section, a, c)}
        theirs = {r["round"]: r for r in self.of(section, b, c)}
        return [(mine[k], theirs[k]) for k in sorted(mine.keys() & theirs.keys())]

    def ratio(self, section: str, key: str, a: str, b: str, c: int | None = None) -> float | None:
        """Median over rounds of a[key] / b[key], pairing the rows of the same round."""
        return med(x[key] / y[key] for x, y in self.paired(section, a, b, c)
                    if x.get(key) is not None and y.get(key))

    def per_chunk_beyond(self, section: str, a: str, b: str) -> float | None:
        """Median over rounds of (CPU per response of a − of b) / events per response of a."""
        return med((x["cpu_us_per_req"] - y["cpu_us_per_req"]) / x["events_per_response"]
                    for x, y in self.paired(section, a, b)
                    if x.get("cpu_us_per_req") is not None and y.get("cpu_us_per_req") is not None
                    and x.get("events_per_response"))

    def slopes(self, t: str) -> dict[int, float]:
        """Per round, t's CPU µs per additional chunk: the same target answered c's short stream and
        c_long's long one in that round, (long − short CPU per response) / (long − short events)."""
        shorts = {r["round"]: r for r in self.of("c", t)}
        out = {}
        for r in self.of("c_long", t):
            s = shorts.get(r["round"])
            if s is None or r.get("cpu_us_per_req") is None or s.get("cpu_us_per_req") is None:
                continue
            extra = r["events_per_response"] - s["events_per_response"]
            if extra > 0:
                out[r["round"]] = (r["cpu_us_per_req"] - s["cpu_us_per_req"]) / extra
        return out

    def marginal_beyond(self, a: str, b: str) -> float | None:
        """Median over rounds of a's CPU per additional chunk minus b's: the per-request work cancels."""
        mine, theirs = self.slopes(a), self.slopes(b)
        return med(mine[k] - theirs[k] for k in sorted(mine.keys() & theirs.keys()))

    def diff(self, section: str, key: str, a: str, b: str, c: int | None = None) -> float | None:
        return med(x[key] - y[key] for x, y in self.paired(section, a, b, c)
                    if x.get(key) is not None and y.get(key) is not None)


def verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("**met**" if ok else "**missed**")
