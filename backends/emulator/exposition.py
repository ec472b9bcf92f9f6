"""Prometheus exposition for aiohttp over a per-emulator registry (never the global one).

`render` behaves like prometheus_client's `make_asgi_app` (SGLang, trtllm-serve): content negotiation
on `Accept` (text 0.0.4 by default, OpenMetrics or text 1.0.0 when asked), gzip on `Accept-Encoding`,
the `name[]` filter. `render_text_latest` is what the captured vLLM 0.32 server does instead.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable, Sequence

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily


def render(registry: CollectorRegistry, request: web.Request) -> web.Response:
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    names = request.query.getall("name[]", [])
    target = registry.restricted_registry(names) if names else registry
    body: bytes = encoder(target)
    headers = {"Content-Type": content_type}
    if "gzip" in request.headers.get("Accept-Encoding", ""):
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers=headers)


def render_text_latest(registry: CollectorRegistry) -> web.Response:
    """vLLM 0.32's `/metrics`: always the text format labelled `version=1.0.0`, whatever the `Accept`
    header says (both captured scrapes, with and without an OpenMetrics Accept, show exactly this)."""
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


class Hist:
    """A plain cumulative histogram for the custom (multiprocess-style) collectors."""

    __slots__ = ("buckets", "count", "counts", "total")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for b, c in zip((*(_fmt(b) for b in self.buckets), "+Inf"), self.counts, strict=True):
            acc += c
            out.append((b, float(acc)))
        return out


def _fmt(b: float) -> str:
    return repr(float(b))


def hist_family(
    name: str, doc: str, labels: dict[str, str], hists: Iterable[tuple[dict[str, str], Hist]]
) -> HistogramMetricFamily:
    """A histogram family; label names are sorted as in prometheus_client's multiprocess mode."""
    fam: HistogramMetricFamily | None = None
    for extra, h in hists:
        merged = dict(sorted({**labels, **extra}.items()))
        if fam is None:
            fam = HistogramMetricFamily(name, doc, labels=list(merged))
        fam.add_metric(list(merged.values()), h.cumulative(), h.total)
    if fam is None:
        fam = HistogramMetricFamily(name, doc, labels=sorted(labels))
    return fam
