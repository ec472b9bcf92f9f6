"""Ended spans to the OTLP exporter, in batches, off the request path; what could not go is counted.

Why not the SDK's `BatchSpanProcessor`: it drops spans when its queue is full and counts them only
in the SDK's own OpenTelemetry metrics (behind `OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED`), which
this gateway, whose metrics are Prometheus families, does not run. This is the same design (a
bounded queue, one exporting thread, the SDK's exporters) with every way a span is lost counted:

- `on_end`, on the request path, appends to a deque or, when `max_queue` spans wait already,
  drops the span (`queue_full`): no lock, no wait, no I/O, whatever the collector does;
- the thread wakes every `delay_s`, or as soon as a batch is full, and exports batches one at a
  time; a batch the exporter fails (after its own retries, bounded by `OTEL_EXPORTER_OTLP_TIMEOUT`)
  is dropped (`export_failed`). An unreachable collector therefore costs the request path nothing:
  spans wait, then go or are dropped, counted either way;
- `shutdown` exports what waits for at most its deadline, in the thread, and drops the rest
  (`shutdown`): a gateway stopping never waits for a collector longer than that.

The exporter's own work (encoding protobuf, the gRPC or HTTP call) runs on this thread; it needs the
GIL for the encoding, which is what sampling 100 % costs the event loop (`bench overhead` measures it).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Final

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..merge_rules import Merge, declare

log = logging.getLogger(__name__)

QUEUE_FULL: Final = "queue_full"
EXPORT_FAILED: Final = "export_failed"
SHUTDOWN: Final = "shutdown"
REASONS: Final = (QUEUE_FULL, EXPORT_FAILED, SHUTDOWN)

# Every worker exports its own spans to the collector: under `--workers N` they add up.
declare(Merge.SUM, "gateway_tracing_spans_exported", "gateway_tracing_spans_dropped", "gateway_tracing_queue_spans")


class Batcher(SpanProcessor):
    """The bounded queue and its exporting thread (see the module docstring)."""

    def __init__(self, exporter: SpanExporter, *, max_queue: int, max_batch: int, delay_s: float) -> None:
        self._exporter = exporter
        self._max_queue = max_queue
        self._max_batch = max_batch
        self._delay_s = delay_s
        self._queue: deque[ReadableSpan] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self.exported = 0  # written by the thread only
        self.failed = 0  # ditto
        self.dropped_full = 0  # written by the request path only
        self.dropped_shutdown = 0
        self._thread = threading.Thread(target=self._run, name="gateway-span-export", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if self._stopping:
            self.dropped_shutdown += 1
            return
        queue = self._queue
        if len(queue) >= self._max_queue:
            self.dropped_full += 1
            return
        queue.append(span)
        if len(queue) >= self._max_batch and not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self._export_all()
        self._export_all()

    def _export_all(self) -> None:
        queue = self._queue
        while queue:
            batch: list[ReadableSpan] = []
            while queue and len(batch) < self._max_batch:
                batch.append(queue.popleft())
            self._export(batch)

    def _export(self, batch: Sequence[ReadableSpan]) -> None:
        try:
            result = self._exporter.export(batch)
        except Exception:  # an exporter's bug must not stop the thread
            log.exception("span export failed")
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(batch)
        else:
            self.failed += len(batch)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what waits now (on the caller's thread: tests and shutdown only)."""
        self._wake.set()
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what waits for up to `timeout_s`, then stop; what is still queued is dropped."""
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        left = len(self._queue)
        if left:
            self._queue.clear()
            self.dropped_shutdown += left
        try:
            self._exporter.shutdown()
        except Exception:
            log.exception("span exporter shutdown failed")


class TracingCollector:
    """The export's counters, read when Prometheus scrapes."""

    def __init__(self, batcher: Batcher) -> None:
        self._batcher = batcher

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        b = self._batcher
        exported = CounterMetricFamily("gateway_tracing_spans_exported", "Spans the OTLP collector accepted.")
        exported.add_metric([], float(b.exported))
        yield exported
        dropped = CounterMetricFamily(
            "gateway_tracing_spans_dropped",
            "Spans lost before the collector had them: the export queue was full, the collector failed or "
            "could not be reached, or the process stopped first.", labels=["reason"])
        for reason, count in zip(REASONS, (b.dropped_full, b.failed, b.dropped_shutdown), strict=True):
            dropped.add_metric([reason], float(count))
        yield dropped
        queue = GaugeMetricFamily("gateway_tracing_queue_spans", "Ended spans waiting for the exporter.")
        queue.add_metric([], float(b.queued))
        yield queue
