"""Envoy's ext_proc messages as the picker reads and writes them: pure functions, no I/O.

What GIE's Endpoint Picker Protocol fixes: the chosen endpoint goes to Envoy as the request header
`x-gateway-destination-endpoint: ip:port` and as the same value in the dynamic metadata
`envoy.lb` / `x-gateway-destination-endpoint` (where a comma-separated list is an ordered fallback
list), with the route cache cleared so that Envoy routes on the new header. Envoy may restrict the
choice to a subset, in the request's metadata `envoy.lb.subset_hint` /
`x-gateway-destination-endpoint-subset` (a list, or a comma string).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from google.protobuf import struct_pb2

from .proto import ext_proc_pb2 as pb

DESTINATION: Final = "x-gateway-destination-endpoint"
SUBSET: Final = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE: Final = "envoy.lb"
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
# ProtocolConfiguration's BodySendMode values
BUFFERED: Final = 2
FULL_DUPLEX_STREAMED: Final = 4
OVERWRITE: Final = pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_dict(headers: pb.HeaderMap) -> dict[str, str]:
    """Envoy's header map as a dict of lower-case names (Envoy sends the value in `raw_value`, older
    ones in `value`); a repeated header keeps its values joined by commas, as HTTP allows."""
    out: dict[str, str] = {}
    for h in headers.headers:
        value = h.raw_value.decode("latin-1") if h.raw_value else h.value
        key = h.key.lower()
        out[key] = out[key] + "," + value if key in out else value
    return out


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints (`ip:port`) Envoy allows for this request, or None when it sets no subset; an
    empty set is a subset that allows nothing (GIE: never fail open)."""
    meta = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in meta:
        return None
    fields = meta[SUBSET_NAMESPACE].fields
    if SUBSET not in fields:
        return None
    value = fields[SUBSET]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items: Iterable[str] = (v.string_value for v in value.list_value.values)
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        return frozenset()
    return frozenset(i.strip() for i in items if i.strip())


def _set(headers: Mapping[str, str]) -> list[pb.HeaderValueOption]:
    return [pb.HeaderValueOption(header=pb.HeaderValue(key=k.lower(), raw_value=v.encode("latin-1")),
                                 append_action=OVERWRITE) for k, v in headers.items()]


def destination_metadata(endpoints: list[str]) -> struct_pb2.Struct:
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION: ",".join(endpoints)}})
    return meta


def routed_headers(endpoint: str, headers: Mapping[str, str], remove: list[str], body: bytes | None
                   ) -> pb.ProcessingResponse:
    """The answer to the request headers (FULL_DUPLEX_STREAMED: sent once the body is in) that sends
    the request to `endpoint`, with `headers` set and `remove` removed; `body` when the body is
    replaced (its length then goes in content-length)."""
    extra = {DESTINATION: endpoint, **headers}
    if body is not None:
        extra["content-length"] = str(len(body))
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=_set(extra), remove_headers=remove),
                               clear_route_cache=True)
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                 dynamic_metadata=destination_metadata([endpoint]))


def routed_body(endpoint: str, headers: Mapping[str, str], remove: list[str], body: bytes | None
                ) -> pb.ProcessingResponse:
    """The answer to a BUFFERED request body: the headers' mutation rides on it (Envoy holds the
    headers until the body is processed), and the whole body when it is replaced."""
    extra = {DESTINATION: endpoint, **headers}
    mutation = None
    if body is not None:
        extra["content-length"] = str(len(body))
        mutation = pb.BodyMutation(body=body)
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=_set(extra), remove_headers=remove),
                               clear_route_cache=True, body_mutation=mutation)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                 dynamic_metadata=destination_metadata([endpoint]))


def continue_request_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def streamed_request_body(body: bytes, *, end: bool) -> pb.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: a chunk of the request body that Envoy sends upstream."""
    mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end))
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation)))


def response_headers(headers: Mapping[str, str]) -> pb.ProcessingResponse:
    """The answer to the response headers: passed on, with the gateway's own headers added."""
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=_set(headers))) if headers else None
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))


def response_body(chunk: bytes, *, end: bool, streamed: bool) -> pb.ProcessingResponse:
    """The answer to a response body chunk: the same bytes (streamed mode sends them back), unchanged."""
    if not streamed:
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end))
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation)))


def trailers(*, response: bool) -> pb.ProcessingResponse:
    if response:
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def immediate(status: int, body: bytes, headers: Mapping[str, str], details: str) -> pb.ProcessingResponse:
    """A response Envoy sends to the client itself (errors: an OpenAI-shaped JSON body)."""
    all_headers = {"content-type": "application/json", **headers}
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=_set(all_headers)), body=body,
        details=details))
