"""The export queue never makes the request path wait, and every span it loses is counted: with an
exporter that hangs (a collector that accepts the connection and never answers), fails, or works.
The exporters here stand in for the SDK's OTLP exporter (the interface the SDK defines); what is
tested is our processor."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry

from gateway.tracing.export import Batcher, TracingCollector


class Exporter(SpanExporter):
    def __init__(self, result: SpanExportResult = SpanExportResult.SUCCESS) -> None:
        self.result = result
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()
        self.batches: list[int] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(10)
        self.batches.append(len(spans))
        return self.result


def spans(batcher: Batcher, n: int) -> None:
    provider = TracerProvider()
    provider.add_span_processor(batcher)
    tracer = provider.get_tracer("t")
    for i in range(n):
        tracer.start_span(f"s{i}").end()


def until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_a_hung_collector_never_holds_the_request_path_and_a_full_queue_drops_the_newest() -> None:
    exporter = Exporter()
    exporter.release.clear()  # the first export hangs until released
    batcher = Batcher(exporter, max_queue=10, max_batch=4, delay_s=0.01)
    spans(batcher, 4)  # a full batch: exported at once, and hangs there
    until(exporter.entered.is_set)
    started = time.perf_counter()
    spans(batcher, 50)  # the request path ends spans while the exporter hangs
    took = time.perf_counter() - started
    assert took < 0.5  # (50 spans; a blocking processor would wait the exporter's 10 s)
    assert batcher.queued == 10
    assert batcher.dropped_full == 40
    exporter.release.set()
    until(lambda: batcher.exported == 14)
    assert exporter.batches == [4, 4, 4, 2]  # batches of at most max_batch
    batcher.shutdown(1.0)


def test_spans_a_collector_refuses_are_counted_as_failed_and_shutdown_is_bounded() -> None:
    exporter = Exporter(SpanExportResult.FAILURE)
    batcher = Batcher(exporter, max_queue=100, max_batch=10, delay_s=0.01)
    spans(batcher, 25)
    until(lambda: batcher.failed == 25)
    assert batcher.exported == 0
    exporter.release.clear()  # the collector hangs; stopping waits at most its deadline
    spans(batcher, 10)
    until(exporter.entered.is_set)
    started = time.monotonic()
    batcher.shutdown(0.3)
    assert time.monotonic() - started < 2.0
    spans(batcher, 3)  # after shutdown: dropped, counted
    assert batcher.dropped_shutdown >= 3
    exporter.release.set()


def test_the_counters_are_prometheus_families() -> None:
    exporter = Exporter()
    batcher = Batcher(exporter, max_queue=2, max_batch=512, delay_s=60)
    spans(batcher, 5)
    registry = CollectorRegistry()
    registry.register(TracingCollector(batcher))
    assert registry.get_sample_value("gateway_tracing_spans_dropped_total", {"reason": "queue_full"}) == 3.0
    assert registry.get_sample_value("gateway_tracing_queue_spans") == 2.0
    batcher.shutdown(2.0)  # what waits is exported before the thread stops
    assert registry.get_sample_value("gateway_tracing_spans_exported_total") == 2.0
    assert registry.get_sample_value("gateway_tracing_spans_dropped_total", {"reason": "export_failed"}) == 0.0
