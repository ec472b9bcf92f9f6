"""The picker's messages beside the tracing exporter's: one environment holds both, unbroken.

`xds-protos` (where Envoy's ext_proc stubs usually come from) ships an old copy of
`opentelemetry/proto/*` that overwrites opentelemetry-proto's and breaks the OTLP exporter. The
picker generates its own messages instead (gateway/picker/proto/ext_proc.proto); these tests fail if
any distribution other than opentelemetry-proto puts files under `opentelemetry/proto/`, if its
version strays from the SDK's, or if the picker's messages stop being Envoy's on the wire."""

from __future__ import annotations

from importlib import metadata

import pytest
from google.protobuf.message import Message

from gateway.picker.proto import ext_proc_pb2 as pb


def test_only_opentelemetry_proto_ships_the_otlp_messages() -> None:
    owners = set()
    for dist in metadata.distributions():
        for file in dist.files or ():
            if str(file).startswith("opentelemetry/proto/"):
                owners.add(dist.metadata["Name"].lower())
                break
    assert owners == {"opentelemetry-proto"}


def test_opentelemetry_proto_matches_the_sdk() -> None:
    assert metadata.version("opentelemetry-proto") == metadata.version("opentelemetry-sdk")


def test_the_otlp_exporter_and_the_picker_messages_load_together() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from opentelemetry.proto.trace.v1 import trace_pb2

    span = trace_pb2.Span(name="s", trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    request = trace_service_pb2.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
        scope_spans=[trace_pb2.ScopeSpans(spans=[span])])])
    assert trace_service_pb2.ExportTraceServiceRequest.FromString(request.SerializeToString()) == request
    assert OTLPSpanExporter is not None
    assert pb.DESCRIPTOR.package == "igw.ext_proc.v3"  # never Envoy's own package: no clash with xds-protos


@pytest.mark.parametrize(("message", "field", "number"), [
    (pb.ProcessingRequest, "request_headers", 2), (pb.ProcessingRequest, "request_body", 4),
    (pb.ProcessingRequest, "response_headers", 3), (pb.ProcessingRequest, "response_body", 5),
    (pb.ProcessingRequest, "response_trailers", 7), (pb.ProcessingRequest, "metadata_context", 8),
    (pb.ProcessingRequest, "protocol_config", 11), (pb.ProcessingResponse, "immediate_response", 7),
    (pb.ProcessingResponse, "dynamic_metadata", 8), (pb.CommonResponse, "clear_route_cache", 5),
    (pb.CommonResponse, "body_mutation", 3), (pb.BodyMutation, "streamed_response", 3),
    (pb.HeaderValue, "raw_value", 3), (pb.HeaderValueOption, "append_action", 3),
    (pb.ImmediateResponse, "details", 5), (pb.HttpHeaders, "end_of_stream", 3),
])
def test_field_numbers_are_envoys(message: type[Message], field: str, number: int) -> None:
    """Envoy's numbers (envoy/service/ext_proc/v3/external_processor.proto, config/core/v3/base.proto)."""
    assert message.DESCRIPTOR.fields_by_name[field].number == number
