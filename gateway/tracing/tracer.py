"""The process's tracer: the SDK's provider and OTLP exporter, and where each request's trace starts.

One per process (`app.build`): under `--workers N` every worker exports its own spans, and so does
every replica; the resource says which (`service.name`, `service.instance.id` = host:pid). The SDK
is imported only here, so a gateway without tracing never loads it.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
from collections.abc import Mapping

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from prometheus_client import CollectorRegistry

from backends.base import Endpoint

from .config import GRPC, TraceConfig
from .context import parent_of
from .export import Batcher, TracingCollector
from .sampled import Sampled, Throughput
from .trace import Trace, new_span_id, new_trace_id

SHUTDOWN_S = 5.0  # what a stopping gateway gives the exporter for the spans still queued


class _Ids(IdGenerator):
    """The SDK's ids, except a trace's: that one was drawn before sampling decided (`Tracer.start`)."""

    def __init__(self) -> None:
        self.next_trace_id = 0

    def generate_span_id(self) -> int:
        return new_span_id()

    def generate_trace_id(self) -> int:
        trace_id, self.next_trace_id = self.next_trace_id, 0
        return trace_id or new_trace_id()


def exporter_for(config: TraceConfig) -> SpanExporter:
    headers = dict(config.headers) or None
    if config.protocol == GRPC:
        return GrpcExporter(endpoint=config.endpoint, headers=headers)
    return HttpExporter(endpoint=config.endpoint, headers=headers)


class Tracer:
    """Starts every request's `Trace`: sampled ones record spans, the others only carry their ids."""

    def __init__(
        self, config: TraceConfig, *, throughput: Throughput, registry: CollectorRegistry | None = None,
        rng: random.Random | None = None, exporter: SpanExporter | None = None,
    ) -> None:
        self.config = config
        self._sampler = config.sampler
        self._names = config.names
        self._throughput = throughput
        self._rng = rng
        self._ids = _Ids()
        resource = Resource.create({"service.name": config.service_name,
                                    "service.instance.id": f"{socket.gethostname()}:{os.getpid()}"})
        self.provider = TracerProvider(sampler=ALWAYS_ON, resource=resource, id_generator=self._ids)
        self.batcher = Batcher(exporter or exporter_for(config), max_queue=config.max_queue_spans,
                               max_batch=config.max_batch_spans, delay_s=config.schedule_delay_s)
        self.provider.add_span_processor(self.batcher)
        self._tracer = self.provider.get_tracer("gateway")
        if registry is not None:
            registry.register(TracingCollector(self.batcher))

    def start(self, headers: Mapping[str, str], endpoint: Endpoint, request_id: str) -> Trace:
        """A request arrived: its trace (a child of the caller's `traceparent` when it sent one)."""
        parent = parent_of(headers)
        if parent is not None:
            trace_id = parent.trace_id
        else:
            trace_id = (self._rng.getrandbits(128) or 1) if self._rng is not None else new_trace_id()
        if not self._sampler.sampled(trace_id, parent):
            return Trace(trace_id, parent)
        self._ids.next_trace_id = trace_id if parent is None else 0
        return Sampled(self._tracer, trace_id, parent, endpoint=endpoint, request_id=request_id, names=self._names,
                       throughput=self._throughput)

    async def close(self) -> None:
        """Export what is queued (at most `SHUTDOWN_S`, off the event loop), then stop exporting."""
        await asyncio.get_running_loop().run_in_executor(None, self.batcher.shutdown, SHUTDOWN_S)
