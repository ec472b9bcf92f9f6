"""One /metrics page for the whole gateway, merged from every worker's families by their declared rules.

Why not prometheus_client's multiprocess mode: it works by giving each *prometheus_client* metric an
mmap file, and the gateway's request families are its own lock-free collectors (`lockfree`) and
scrape-time collectors (pool gauges, the live comparison), which it cannot see. So the supervisor
asks each worker for its families (`dump`: the registry's collected samples as plain data, each
family with the merge rule it declared where it is defined, `gateway.merge_rules`, over the
worker's private channel) and serves their merge, the way Envoy's hot restart merges the stats of
its generations. By rule (`Merge`):

- `sum`: gauges are summed over the live workers; counters and histograms (`_total`, `_bucket`,
  `_count`, `_sum`) too, and a worker that died keeps contributing the last values it reported
  (`retire`), so every series stays monotonic while workers come and go (only what a crashed
  worker counted after its last report is lost; the supervisor asks every few seconds besides each
  scrape);
- `max`, `min`, `harmonic`: gauges of one shared thing, combined so (see `merge_rules`);
- `once`: the family's voice is the oldest live worker that has it: its gauges are taken as they
  are, and its counters' progress is added to what the gateway had counted; when it goes, the next
  oldest takes over from where its own counters stand (they had counted the same events), so an
  event every worker observed counts once, and a worker that starts again does not count again
  what the others had counted;
- `worker`: one series per worker slot, with a `worker` label; a slot's counters continue across
  its worker's restarts, like sums;
- a family that declares no rule (or a counter declared with a gauge's rule) is merged as `worker`,
  never summed, and logged once.

Whatever the rule, a counter never goes backwards in the merge: a live worker's series that goes
down (its state was recreated) or disappears keeps what it had counted. `_created` samples are
dropped: a merge of several processes' creation times means nothing. Exemplars (a histogram
bucket's link to the trace of one request in it, `observability.lockfree`) merge by recency: a
merged bucket carries the newest exemplar any worker reported for it, and keeps it when that worker
goes (it points at a trace, which outlives the worker that recorded it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Exemplar, Metric
from prometheus_client.exposition import choose_encoder

from ..merge_rules import COUNTER_RULES, Merge, rule_of

log = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]
Sample = tuple[str, Labels]  # (sample name, labels) within a family
# [[name, type, documentation, unit, [[sample name, labels, value(, exemplar)], ...], rule], ...]
# with exemplar = [labels, value, timestamp] on the bucket samples that have one
Dump = list[list[Any]]
Kept = tuple[dict[str, str], float, float | None]  # an exemplar: labels, value, timestamp

MONOTONIC_TYPES = frozenset({"counter", "histogram", "summary"})
MONOTONIC_SUFFIXES = ("_total", "_bucket", "_count", "_sum")
WORKER_LABEL = "worker"


def dump(registry: CollectorRegistry) -> Dump:
    """Every family `registry` collects now, as plain data (for the channel), with its merge rule."""
    out: Dump = []
    for m in registry.collect():
        samples = [[s.name, s.labels, s.value] if s.exemplar is None else
                   [s.name, s.labels, s.value, [s.exemplar.labels, s.exemplar.value, s.exemplar.timestamp]]
                   for s in m.samples if not s.name.endswith("_created")]
        rule = rule_of(m.name)
        out.append([m.name, m.type, m.documentation, m.unit, samples, None if rule is None else rule.value])
    return out


def _key(labels: Mapping[str, str]) -> Labels:
    return tuple(sorted(labels.items()))


def _value(raw: Any) -> float:
    return math.nan if raw is None else float(raw)  # orjson writes NaN as null


def _monotonic(kind: str, sample: str) -> bool:
    return kind in MONOTONIC_TYPES and sample.endswith(MONOTONIC_SUFFIXES)


def _combine(rule: Merge, values: list[float]) -> float:
    if rule is Merge.MIN:
        return min(values)
    if rule is Merge.MAX:
        return max(values)
    if rule is Merge.HARMONIC:
        inverse = math.fsum(1.0 / v for v in values if v > 0)
        return 1.0 / inverse if inverse > 0 else math.nan
    return math.fsum(values)


@dataclass
class _Family:
    kind: str
    documentation: str
    unit: str
    rule: Merge
    order: dict[Sample, dict[str, str]] = field(default_factory=dict)  # first-seen sample order


@dataclass
class _Voice:
    """A `once` family: which live worker speaks for it, and what the gateway has counted."""

    source: str | None = None
    counted: dict[Sample, float] = field(default_factory=dict)  # the gateway's count of each series
    heard: dict[Sample, float] = field(default_factory=dict)  # the voice's own counts already in `counted`


class _Counts:
    """One live worker's counters: the last value of each series, plus what its recreated series had
    counted before they went down (so that its counts only ever go up)."""

    def __init__(self) -> None:
        self.last: dict[str, dict[Sample, float]] = {}
        self.carried: dict[str, dict[Sample, float]] = {}

    def see(self, family: str, sample: Sample, value: float) -> None:
        last = self.last.setdefault(family, {})
        before = last.get(sample)
        if before is not None and value < before:  # the worker made this counter anew
            carried = self.carried.setdefault(family, {})
            carried[sample] = carried.get(sample, 0.0) + before
        last[sample] = value

    def of(self, family: str) -> dict[Sample, float]:
        carried = self.carried.get(family, {})
        return {s: v + carried.get(s, 0.0) for s, v in self.last.get(family, {}).items()}


class ScrapeMerger:
    """The latest dump of every live source (oldest first), plus what the retired ones had counted."""

    def __init__(self) -> None:
        self._live: dict[str, Dump] = {}
        self._workers: dict[str, str] = {}  # source -> its `worker` label value
        self._counts: dict[str, _Counts] = {}
        self._families: dict[str, _Family] = {}
        # (family, sample) -> {worker label ("" for `sum`): what retired sources had counted}
        self._retired: dict[tuple[str, Sample], dict[str, float]] = {}
        self._voices: dict[str, _Voice] = {}
        self._warned: set[str] = set()
        self._exemplars: dict[tuple[str, Sample], Kept] = {}  # the newest of each bucket, from any source

    @property
    def sources(self) -> list[str]:
        return list(self._live)

    def update(self, source: str, families: Dump, *, worker: str | None = None) -> None:
        """`source`'s families now; `worker` labels its series of `worker` families (default: `source`)."""
        self._live[source] = families
        self._workers[source] = worker if worker is not None else source
        counts = self._counts.setdefault(source, _Counts())
        for name, kind, doc, unit, samples, rule in families:
            family = self._family(name, kind, doc, unit, rule)
            for row in samples:
                sample, labels, value = row[0], row[1], row[2]
                key = (sample, _key(labels))
                family.order.setdefault(key, labels)
                if _monotonic(kind, sample):
                    counts.see(name, key, _value(value))
                if len(row) > 3:
                    self._keep_exemplar(name, key, row[3])
        self._listen()

    def _keep_exemplar(self, family: str, key: Sample, raw: list[Any]) -> None:
        labels, value, at = dict(raw[0]), _value(raw[1]), None if raw[2] is None else float(raw[2])
        kept = self._exemplars.get((family, key))
        if kept is None or (at or 0.0) >= (kept[2] or 0.0):
            self._exemplars[(family, key)] = (labels, value, at)

    def retire(self, source: str) -> None:
        """`source` is gone: what it counted stays in every merge from now on, its gauges go."""
        if self._live.pop(source, None) is None:
            return
        worker = self._workers.pop(source)
        counts = self._counts.pop(source)
        for name in counts.last:
            rule = self._families[name].rule
            if rule is Merge.ONCE:
                continue  # counted through its voice already
            by = worker if rule is Merge.WORKER else ""
            for sample, value in counts.of(name).items():
                kept = self._retired.setdefault((name, sample), {})
                kept[by] = kept.get(by, 0.0) + value
        self._listen()

    def _family(self, name: str, kind: str, doc: str, unit: str, declared: str | None) -> _Family:
        try:
            rule: Merge | None = None if declared is None else Merge(declared)
        except ValueError:
            rule = None
        if rule is None or (kind in MONOTONIC_TYPES and rule not in COUNTER_RULES):
            if name not in self._warned:
                self._warned.add(name)
                log.warning("metric family %s declares no merge rule for a %s (gateway.merge_rules): "
                            "shown per worker", name, kind)
            rule = Merge.WORKER
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = _Family(kind, doc, unit, rule)
        else:
            family.kind, family.documentation, family.unit, family.rule = kind, doc, unit, rule
        return family

    def _listen(self) -> None:
        """Advance every `once` family's count by its voice's progress (a new voice if the last went)."""
        having: dict[str, list[str]] = {}
        for source, families in self._live.items():  # oldest first
            for row in families:
                if self._families[row[0]].rule is Merge.ONCE:
                    having.setdefault(row[0], []).append(source)
        for name, sources in having.items():
            voice = self._voices.setdefault(name, _Voice())
            if voice.source not in sources:
                if voice.source is not None:  # a handover: the series the gateway counted, the old voice had
                    voice.heard = {s: v for s, v in self._counts[sources[0]].of(name).items() if s in voice.counted}
                voice.source = sources[0]
            for sample, value in self._counts[voice.source].of(name).items():
                heard = voice.heard.get(sample, 0.0)
                if value > heard:
                    voice.counted[sample] = voice.counted.get(sample, 0.0) + value - heard
                    voice.heard[sample] = value
                else:
                    voice.counted.setdefault(sample, 0.0)  # (a series first heard at 0)

    def families(self) -> Iterator[Metric]:
        gauges: dict[str, dict[Sample, list[tuple[str, float]]]] = {}
        for source, families in self._live.items():
            for name, kind, _, _, samples, _ in families:
                into = gauges.setdefault(name, {})
                for row in samples:
                    sample, labels, value = row[0], row[1], row[2]
                    if not _monotonic(kind, sample):
                        into.setdefault((sample, _key(labels)), []).append((source, _value(value)))
        counts = {source: c for source, c in self._counts.items() if source in self._live}
        for name, family in self._families.items():
            metric = Metric(name, family.documentation, family.kind, family.unit)
            seen = gauges.get(name, {})
            live_counts = {source: c.of(name) for source, c in counts.items()}
            for key, labels in family.order.items():
                if _monotonic(family.kind, key[0]):
                    self._add_count(metric, name, family.rule, key, labels, live_counts)
                else:
                    self._add_gauge(metric, name, family.rule, key, labels, seen.get(key, []))
            if metric.samples:
                yield metric

    def _add_count(self, metric: Metric, name: str, rule: Merge, key: Sample, labels: dict[str, str],
                   live: Mapping[str, Mapping[Sample, float]]) -> None:
        sample = key[0]
        kept = self._exemplars.get((name, key))
        exemplar = None if kept is None else Exemplar(*kept)
        if rule is Merge.ONCE:
            voice = self._voices.get(name)
            if voice is not None and key in voice.counted:
                metric.add_sample(sample, labels, voice.counted[key], exemplar=exemplar)
            return
        retired = self._retired.get((name, key), {})
        if rule is Merge.WORKER:
            per = dict(retired)
            for source, values in live.items():
                if key in values:
                    worker = self._workers[source]
                    per[worker] = per.get(worker, 0.0) + values[key]
            for worker in sorted(per):
                metric.add_sample(sample, {**labels, WORKER_LABEL: worker}, per[worker], exemplar=exemplar)
            return
        counted = [v[key] for v in live.values() if key in v]
        if counted or retired:
            metric.add_sample(sample, labels, math.fsum([*counted, *retired.values()]), exemplar=exemplar)

    def _add_gauge(self, metric: Metric, name: str, rule: Merge, key: Sample, labels: dict[str, str],
                   values: list[tuple[str, float]]) -> None:
        if not values:
            return
        if rule is Merge.ONCE:
            voice = self._voices.get(name)
            chosen = [v for s, v in values if voice is not None and s == voice.source]
            if chosen:
                metric.add_sample(key[0], labels, chosen[0])
        elif rule is Merge.WORKER:
            per = {self._workers[s]: v for s, v in values}
            for worker in sorted(per):
                metric.add_sample(key[0], {**labels, WORKER_LABEL: worker}, per[worker])
        else:
            metric.add_sample(key[0], labels, _combine(rule, [v for _, v in values]))

    def render(self, accept: str) -> tuple[bytes, str]:
        """The merged page, encoded as `accept` asks (text 0.0.4 or OpenMetrics)."""
        encoder, content_type = choose_encoder(accept)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Frozen(list(self.families())))
        body: bytes = encoder(registry)
        return body, content_type


class _Frozen:
    def __init__(self, metrics: Iterable[Metric]) -> None:
        self._metrics = list(metrics)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self._metrics
