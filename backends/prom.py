"""Read Prometheus scrapes with prometheus_client's own parsers, never regexes.

Runtimes differ in label order (multiprocess mode sorts labels, prometheus-cpp too), in format
(text 0.0.4 vs OpenMetrics, chosen by the scraper's Accept header) and in counter naming (a counter
`x` is exposed as the sample `x_total` in both formats). Indexing by *sample* name and matching labels
as a subset makes all of these look the same to the adapters. OpenMetrics exposition with
`escaping=underscores` (prometheus_client >= 0.22, what Prometheus 3.x asks for) rewrites `vllm:x` to
`vllm_x`, so names are compared with `:` folded to `_`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.openmetrics.parser import text_string_to_metric_families as _parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as _parse_text

from backends.base import LoadParseError


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


class Scrape:
    """All finite samples of one scrape, indexed by sample name (e.g. `vllm:prefix_cache_hits_total`)."""

    __slots__ = ("_by_name",)

    def __init__(self, samples: Iterable[Sample]) -> None:
        by_name: dict[str, list[Sample]] = {}
        for s in samples:
            by_name.setdefault(_key(s.name), []).append(s)
        self._by_name = by_name

    def select(self, name: str, labels: Mapping[str, str] | None = None) -> list[Sample]:
        """Samples called `name` whose labels include every `labels` pair."""
        found = self._by_name.get(_key(name), [])
        if not labels:
            return list(found)
        return [s for s in found if all(s.labels.get(k) == v for k, v in labels.items())]

    def sum(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """Sum over matching samples (e.g. over DP `engine` labels); None when there are none."""
        found = self.select(name, labels)
        return math.fsum(s.value for s in found) if found else None

    def mean(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """Mean over matching samples: the right aggregate for per-engine fractions."""
        found = self.select(name, labels)
        return math.fsum(s.value for s in found) / len(found) if found else None

    def counter(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """Sum of a counter given by family or sample name: tries `name_total`, then `name`."""
        base = name.removesuffix("_total")
        total = self.sum(base + "_total", labels)
        return total if total is not None else self.sum(base, labels)

    def label(self, name: str, label: str) -> str | None:
        """The value of `label` on the first sample called `name` (info-style gauges)."""
        for s in self._by_name.get(_key(name), []):
            if label in s.labels:
                return s.labels[label]
        return None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _key(name) in self._by_name


def _key(name: str) -> str:
    return name.replace(":", "_")


def parse(body: bytes) -> Scrape:
    """Parse a text 0.0.4 / 1.0.0 or OpenMetrics body. Raises only LoadParseError."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LoadParseError(f"metrics body is not UTF-8: {exc}") from exc
    # OpenMetrics bodies end with "# EOF"; its parser insists on it, and the text parser would choke on
    # OpenMetrics-only syntax (exemplars, `# UNIT`), so pick by the terminator. prometheus_client's
    # own OpenMetrics parser rejects its underscore-escaped output (`# TYPE vllm:x` over `vllm_x`
    # samples: "Clashing name"); the text parser reads those samples fine, so it is the fallback.
    if text.rstrip().endswith("# EOF"):
        with contextlib.suppress(Exception):  # retried with the lenient text parser below
            return Scrape(_samples(_parse_openmetrics, text if text.endswith("\n") else text + "\n"))
    try:
        samples = _samples(_parse_text, text)
    except Exception as exc:  # the parsers raise ValueError, IndexError, KeyError, ...: one type out
        raise LoadParseError(f"unparseable metrics body: {exc}") from exc
    return Scrape(samples)


def _samples(parser: Callable[[str], Iterable[Any]], text: str) -> list[Sample]:
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in parser(text)
        for s in family.samples
        if not math.isnan(float(s.value))
    ]


def to_int(value: str | float | None) -> int | None:
    """An integer label/sample value ("16", 64.0), or None for "None", "", NaN and garbage."""
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    if not math.isfinite(number) or number != int(number):
        return None
    return int(number)
