"""`python -m bench.otlp_sink`: an OTLP/gRPC trace collector that accepts every export and keeps only a
count (what `bench overhead`'s traced gateways export to: the gateway does all its exporting work,
and the sink's own CPU, in its own process group, is not the gateway's). Prints `listening on URL`."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    spans = 0

    async def Export(  # the generated service's method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext[Any, Any],
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        Sink.spans += sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


async def main() -> None:
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
