"""How the values several processes export for one metric family combine: declared with the family.

Under `--workers N` every worker has its own registry, and the supervisor serves one /metrics page
merged from all of them (`cluster.scrape`). Whether a family's values add up (each worker counted
the requests it served) or describe one thing that every worker sees (a backend's configured price,
the supervisor's probe of a backend, an engine's cache, a discovery source) is a property of the
family, not of the merge. So it is declared where the family is defined, with
`declare(rule, *families)` next to the definition, and `cluster.scrape.dump` sends each family's
rule with its samples. Nothing is summed by default: a family without a rule is shown per worker
(and `tests/unit/test_merge_rules.py` fails on any family of a fully configured gateway that has
none).

The rules (`Merge`):

- `sum`: each process has its own share (requests, tokens, in flight, connections, CPU, memory).
  Counters and histograms also keep a retired worker's last values, so they never go backwards.
- `max`, `min`: gauges of one shared thing that every worker reads (max: the same value from one
  source, such as the config or the supervisor's probe, or the largest reading; min: 1 only where
  every worker agrees, such as a backend that every worker routes to).
- `harmonic`: 1/x adds up (cost per 1M tokens: 1/c = sum of 1/c_i for c_i = price / throughput_i).
- `once`: every worker observes the same events (a discovery source's answers, an engine's KV
  batches): the oldest live worker's values are the gateway's, and its counters are continued by
  the next oldest when it goes, so one event counts once, never twice and never backwards.
- `worker`: per-process facts with no gateway-wide reading (the file-descriptor pair: the limit is
  per process): one series per worker slot, under a `worker` label.

Counters and histograms take `sum`, `once` or `worker`; gauges take any rule. This module imports
nothing, so that every room may declare its families.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final


class Merge(StrEnum):
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    HARMONIC = "harmonic"
    ONCE = "once"
    WORKER = "worker"


COUNTER_RULES: Final = frozenset({Merge.SUM, Merge.ONCE, Merge.WORKER})

_RULES: dict[str, Merge] = {}


def family_name(name: str) -> str:
    """A family's name as a registry collects it (prometheus_client drops a counter's `_total`)."""
    return name.removesuffix("_total")


def declare(rule: Merge, *families: str) -> None:
    """`families` (names as defined: a counter's `_total` may be left on) merge by `rule`. Declaring
    a family again with the same rule is harmless; with another, a ValueError."""
    for name in families:
        key = family_name(name)
        old = _RULES.setdefault(key, rule)
        if old is not rule:
            raise ValueError(f"{key}: merge rule {rule.value} declared, but it was declared {old.value} before")


def rule_of(family: str) -> Merge | None:
    return _RULES.get(family_name(family))


def declared() -> Mapping[str, Merge]:
    """Every declaration so far (read-only), by family name."""
    return MappingProxyType(_RULES)
