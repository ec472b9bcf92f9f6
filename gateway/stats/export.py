"""Windows that travel: a book's buckets as plain data, and one book merged from many.

A gateway's comparison must cover every process that serves it: the workers of one host (their
supervisor asks each for `export_book` over its private socket) and, with a shared store, every
replica of the fleet (each publishes its host's export to Redis with a time to live). `merge` turns
any number of exports into a `MergedBook` that the comparison (`Comparer`, `figures`, `history`)
reads exactly like a live one.

What a merge guarantees:
- counts (requests, errors, tokens, SLA tallies) and throughput (output tokens attributed to each
  second) are the exact sums of the sources';
- inter-token gaps are log-cell histograms (`GapHistogram`): merged by adding counts, exactly;
- the other latency percentiles (TTFT, TPOT, end to end) come from the union of the sources'
  reservoirs: while no source bucket overflowed its cap the merged samples are exactly the sources'
  samples (the figures are exact); otherwise the merged bucket holds as many samples, drawn from the
  sources' in proportion to what each stands for (`seen / kept`, seeded);
- best throughput: the spans each source already scored are summed by their end second (spans end
  on whole multiples of 10 s of the shared clock, `peak`), and the spans not yet scored everywhere
  are scored again from the merged 1-s buckets.

A process that stopped (a worker that crashed) leaves its last export behind: `close` finishes its
best-throughput spans from its own buckets (nothing more will come), and a merge counts a closed
export in the groups the serving processes have, without holding back where their scoring stands,
until it is older than `KEEP_S` (`expired`): then nothing of it is in any window any more.

Only completed seconds and minutes travel (the comparison never reads the current one). Buckets are
indexed by the seconds of the exporting process's clock. Every gateway process runs on
the same clock (`cluster.clock.gateway_clock`: monotonic, anchored to the Unix epoch at start), so
the workers of a host agree to the microsecond and replicas to their hosts' NTP offset. `thin` (the
`max_samples` argument) bounds what is sent: each reservoir keeps at most that many evenly spaced
samples and still counts everything it saw. A merge at `now` reads only the buckets its windows
cover at `now` (older or newer rows of an export taken at another time are left out, so they cannot
take the ring slot of a current one).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..observability.outcome import Cell, GapHistogram
from ..observability.reservoir import Reservoir
from .book import Group, WeightsFn
from .peak import PEAK_HORIZON_S, PEAK_SPAN_S
from .views import BookView
from .window import COARSE_BUCKETS, COARSE_CAPS, COARSE_S, FINE_BUCKETS, Bucket, Ring, Series

VERSION = 2
# how long a closed export still counts: the longest window (and the best-throughput horizon), plus
# the minute a window's first bucket may begin before it
KEEP_S = max(COARSE_BUCKETS * COARSE_S, PEAK_HORIZON_S) + COARSE_S
_COUNTS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens", "sla_met", "sla_missed")
_SAMPLES = ("ttft", "tpot", "e2e")

Export = dict[str, Any]


def _reservoir(r: Reservoir, max_samples: int | None) -> list[Any]:
    kept = r.values
    n = len(kept)
    if max_samples is not None and n > max_samples:
        return [r.seen, [kept[(i * n) // max_samples] for i in range(max_samples)]]
    return [r.seen, kept.tolist()]


def _gaps(h: GapHistogram) -> list[Any]:
    return [h.count, [[i, c.count, c.lo, c.hi] for i, c in h.cells.items()]]


def _bucket(b: Bucket, max_samples: int | None) -> list[Any]:
    return [b.index, *(getattr(b, k) for k in _COUNTS), b.output_tokens,
            *(_reservoir(getattr(b, k), max_samples) for k in _SAMPLES), _gaps(b.itl)]


def _group(g: Group, now: float, max_samples: int | None) -> dict[str, Any]:
    s = g.series
    cur = int(now)
    next_end, spans = s.peak.state()
    return {
        "kind": g.kind, "name": g.name, "backends": list(g.backends), "runtime": g.runtime, "route": g.route,
        "start_s": s.start_s,
        "fine": [_bucket(b, max_samples) for b in s.fine.range(cur - FINE_BUCKETS, cur)],
        "coarse": [_bucket(b, max_samples) for b in s.coarse.range(cur // COARSE_S - COARSE_BUCKETS,
                                                                   cur // COARSE_S)],
        "peak": [next_end, [list(span) for span in spans]],
    }


def _groups(book: BookView) -> list[Group]:
    return [*book.backends.values(), *book.ranks.values(), *book.runtimes.values(), *book.arms.values(),
            *book.pairs.values(), *book.pair_legs.values(), *book.topologies.values(), book.total]


def export_book(book: BookView, now: float, *, max_samples: int | None = None) -> Export:
    """Everything the comparison needs of `book` at `now` (plain lists and numbers: JSON as it is)."""
    routes = sorted({g.route for g in book.arms.values() if g.route is not None})
    return {
        "version": VERSION,
        "now": now,
        "started_at": book.started_at,
        "prices": dict(book.prices),
        "weights": {r: dict(book.weights(r)) for r in routes},
        "groups": [_group(g, now, max_samples) for g in _groups(book)],
    }


def close(export: Export) -> Export:
    """`export` of a process that has stopped, for keeping (nothing more will come): each group's
    minute that was under way gets its 1-minute bucket, from its 1-s buckets (an export carries only
    completed minutes), and its best-throughput spans are scored up to its last second from its 1-s
    buckets, so that merging it never holds back where the serving processes' scoring stands."""
    if export.get("version") != VERSION or export.get("closed"):
        return export
    rng = random.Random(0)
    last = -(-int(export["now"]) // PEAK_SPAN_S) * PEAK_SPAN_S  # the end of the span of its last second
    minute = int(export["now"]) // COARSE_S
    groups = []
    for g in export["groups"]:
        coarse = list(g["coarse"])
        under_way = [row for row in g["fine"] if int(row[0]) // COARSE_S == minute]
        if under_way and all(int(row[0]) != minute for row in coarse):
            b = Bucket(minute, COARSE_CAPS)
            _fill_bucket(b, under_way, rng)
            coarse.append(_bucket(b, None))
        next_end, spans = g["peak"]
        by_end: dict[int, float] = {}
        for row in g["fine"]:
            end = (int(row[0]) // PEAK_SPAN_S + 1) * PEAK_SPAN_S
            by_end[end] = by_end.get(end, 0.0) + float(row[len(_COUNTS) + 1])
        scored = [list(span) for span in spans]
        end = int(next_end)
        while end <= last:
            if by_end.get(end, 0.0) > 0:
                scored.append([end, by_end[end] / PEAK_SPAN_S])
            end += PEAK_SPAN_S
        groups.append({**g, "coarse": coarse, "peak": [end, scored]})
    return {**export, "groups": groups, "closed": True}


def expired(export: Export, now: float) -> bool:
    """Whether nothing of `export` (taken at its `now`) is in any window at `now`."""
    return now - float(export["now"]) > KEEP_S


@dataclass
class _Parts:
    """One merged group's sources, gathered before anything is built."""

    kind: str
    name: str
    route: str | None
    runtime: str | None
    backends: dict[str, None] = field(default_factory=dict)
    start_s: int | None = None
    fine: dict[int, list[list[Any]]] = field(default_factory=dict)
    coarse: dict[int, list[list[Any]]] = field(default_factory=dict)
    peaks: list[tuple[int, list[list[float]], bool]] = field(default_factory=list)  # (next end, spans, closed)


def _merged_reservoir(parts: Sequence[list[Any]], rng: random.Random) -> Reservoir:
    kept = sum(len(values) for _, values in parts)
    merged = Reservoir(max(kept, 1))
    exact = all(seen == len(values) for seen, values in parts)  # nobody overflowed: the exact samples
    if exact or len(parts) == 1:  # (or one source: its sample and its weight as they are)
        merged.values = [v for _, values in parts for v in values]
        merged.seen = kept if exact else int(parts[0][0])
        return merged
    values = [v for _, vs in parts for v in vs]
    weights = [int(seen) / len(vs) for seen, vs in parts for _ in vs]
    merged.values = rng.choices(values, weights, k=kept)
    merged.seen = sum(int(seen) for seen, _ in parts)
    return merged


def _merged_gaps(parts: Sequence[list[Any]]) -> GapHistogram:
    merged = GapHistogram()
    for count, cells in parts:
        source = GapHistogram()
        source.count = int(count)
        source.cells = {int(i): Cell(int(i), int(n), float(lo), float(hi)) for i, n, lo, hi in cells}
        merged.merge(source)
    return merged


def _fill_bucket(b: Bucket, sources: Sequence[list[Any]], rng: random.Random) -> None:
    for i, name in enumerate(_COUNTS, start=1):
        setattr(b, name, sum(int(row[i]) for row in sources))
    b.output_tokens = sum(float(row[len(_COUNTS) + 1]) for row in sources)
    for j, name in enumerate(_SAMPLES, start=len(_COUNTS) + 2):
        setattr(b, name, _merged_reservoir([row[j] for row in sources], rng))
    b.itl = _merged_gaps([row[len(_COUNTS) + 2 + len(_SAMPLES)] for row in sources])


def _fill(ring: Ring, rows: Mapping[int, list[list[Any]]], readable: range, rng: random.Random) -> None:
    for index, sources in rows.items():
        if index in readable:
            _fill_bucket(ring.at(index), sources, rng)


def _series(p: _Parts, now: float, rng: random.Random) -> Series:
    start_s = p.start_s if p.start_s is not None else int(now)
    series = Series(float(start_s), rng)
    cur = int(now)  # what the windows read at `now` (`window.Series.view`)
    _fill(series.fine, p.fine, range(cur - FINE_BUCKETS, cur), rng)
    _fill(series.coarse, p.coarse, range(cur // COARSE_S - COARSE_BUCKETS, cur // COARSE_S), rng)
    if p.peaks:
        # where scoring goes on: the serving exports' earliest; a closed export has scored every span
        # it will ever have (`close`), so with none serving, every span any of them scored counts
        serving = [n for n, _, closed in p.peaks if not closed]
        next_end = min(serving) if serving else max(n for n, _, _ in p.peaks)
        sums: dict[int, float] = {}
        for _, spans, _ in p.peaks:
            for end, tps in spans:
                if end < next_end:  # later spans are scored again, from the merged buckets
                    sums[int(end)] = sums.get(int(end), 0.0) + float(tps)
        series.peak.restore(next_end, sorted(sums.items()))
    series.advance(now)
    return series


@dataclass
class MergedBook:
    """A read-only book of windows merged from exports (see the module docstring); `sources` is how
    many exports went into it."""

    started_at: float
    prices: dict[str, float | None]
    total: Group
    backends: dict[str, Group]
    runtimes: dict[str, Group]
    arms: dict[tuple[str, str], Group]
    sources: int
    ranks: dict[str, Group]
    _weights: dict[str, dict[str, float]]
    pairs: dict[tuple[str, str], Group]
    pair_legs: dict[tuple[str, str], Group]
    topologies: dict[tuple[str, str], Group]

    @property
    def weights(self) -> WeightsFn:
        table = self._weights
        return lambda route: table.get(route, {})


def merge(exports: Iterable[Export], *, now: float, seed: int = 0) -> MergedBook:
    """One book from several exports taken at about `now` (a group is identified by its kind, name
    and route; the first export that names a price or an arm weight wins, a serving one before a
    closed one). A closed export (`close`) counts only in the groups that a serving export has (when
    there is one): a backend or arm that has left the config does not come back with it."""
    rng = random.Random(seed)
    parts: dict[tuple[str, str, str | None], _Parts] = {}
    prices: dict[str, float | None] = {}
    weights: dict[str, dict[str, float]] = {}
    started: list[float] = []
    count = 0
    docs = [doc for doc in exports if doc.get("version") == VERSION]
    serving = [doc for doc in docs if not doc.get("closed")]
    for doc in [*serving, *(doc for doc in docs if doc.get("closed"))]:
        closed = bool(doc.get("closed"))
        count += 1
        started.append(float(doc["started_at"]))
        for name, price in doc["prices"].items():
            prices.setdefault(name, price)
        for route, table in doc["weights"].items():
            weights.setdefault(route, {k: float(v) for k, v in table.items()})
        for g in doc["groups"]:
            key = (g["kind"], g["name"], g["route"])
            p = parts.get(key)
            if p is None:
                if closed and serving:
                    continue
                p = parts[key] = _Parts(g["kind"], g["name"], g["route"], g["runtime"])
            p.backends.update(dict.fromkeys(g["backends"]))
            p.start_s = int(g["start_s"]) if p.start_s is None else min(p.start_s, int(g["start_s"]))
            for row in g["fine"]:
                p.fine.setdefault(int(row[0]), []).append(row)
            for row in g["coarse"]:
                p.coarse.setdefault(int(row[0]), []).append(row)
            next_end, spans = g["peak"]
            p.peaks.append((int(next_end), spans, closed))
    groups = {key: Group(p.kind, p.name, tuple(p.backends), p.runtime, p.route, _series(p, now, rng))
              for key, p in parts.items()}
    total = next((g for g in groups.values() if g.kind == "total"), None)
    if total is None:
        total = Group("total", "all", (), None, None, Series(now, rng))
    return MergedBook(
        started_at=min(started) if started else now,
        prices=prices,
        total=total,
        backends={g.name: g for g in groups.values() if g.kind == "backend"},
        runtimes={g.name: g for g in groups.values() if g.kind == "runtime"},
        arms={(g.route or "", g.name): g for g in groups.values() if g.kind == "arm"},
        sources=count,
        ranks={g.name: g for g in groups.values() if g.kind == "rank"},
        _weights=weights,
        pairs={(g.route or "", g.name): g for g in groups.values() if g.kind == "pair"},
        pair_legs={(g.route or "", g.name): g for g in groups.values() if g.kind == "pair_legs"},
        topologies={(g.route or "", g.name): g for g in groups.values() if g.kind == "topology"},
    )


__all__ = ["KEEP_S", "VERSION", "Export", "MergedBook", "close", "expired", "export_book", "merge"]
