"""One ext_proc stream (one HTTP request through Envoy): the conversation, message by message.

Request path, as GIE's Endpoint Picker Protocol has it: the headers, then the body until its end,
then the choice. With `FULL_DUPLEX_STREAMED` (what GIE's and llm-d's Envoy configs use) the headers
are answered only once the body is in: the headers' answer carries the destination (header, dynamic
metadata, route cache cleared), and the body goes back to Envoy as one streamed chunk. With
`BUFFERED` the headers are answered at once and the destination rides on the body's answer (Envoy
holds the headers until then). Errors are an `ImmediateResponse` with an OpenAI-shaped body.

Response path: headers, body chunks and trailers are passed back unchanged (streamed mode echoes each
chunk) while `Picked` reads them. The request is recorded when the stream ends, however it ends.
"""

from __future__ import annotations

import logging
from typing import Final

from ..errors import GatewayError, InvalidRequest
from . import wire
from .exchange import Picked, Picking
from .proto import ext_proc_pb2 as pb

log = logging.getLogger(__name__)

MAX_BODY_BYTES: Final = 32 * 1024 * 1024


class BodyTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"


def error_response(exc: GatewayError) -> pb.ProcessingResponse:
    return wire.immediate(exc.status, exc.render(), exc.headers, f"gateway_{exc.status}")


class Conversation:
    """The state of one stream; `run` turns Envoy's messages into the picker's answers."""

    def __init__(self, picking: Picking, *, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self._picking = picking
        self._max_body = max_body_bytes
        self._request_mode = 0
        self._response_streamed = False
        self._headers: dict[str, str] = {}
        self._subset: frozenset[str] | None = None
        self._body = bytearray()
        self.picked: Picked | None = None
        self.done = False  # an immediate response was sent: nothing more to say

    def close(self) -> None:
        """The stream is over, however it ended: the request is recorded (once)."""
        if self.picked is not None:
            self.picked.close()

    async def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one message (none, one, or two: FULL_DUPLEX_STREAMED's headers and body)."""
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self._request_mode = config.request_body_mode
            self._response_streamed = config.response_body_mode == wire.FULL_DUPLEX_STREAMED
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self._headers = wire.header_dict(message.request_headers.headers)
            self._subset = wire.subset_hint(message)
            if message.request_headers.end_of_stream:
                return await self._route(headers_only=True)
            if self._request_mode != wire.FULL_DUPLEX_STREAMED:
                return [wire.continue_request_headers()]
        elif kind == "request_body":
            chunk = message.request_body
            if self.picked is None:
                self._body += chunk.body
                if len(self._body) > self._max_body:
                    self.done = True
                    return [error_response(BodyTooLarge(f"The request body is over {self._max_body} bytes."))]
                if chunk.end_of_stream:
                    return await self._route(headers_only=False)
            elif self._request_mode == wire.FULL_DUPLEX_STREAMED:  # (not expected: the body ended)
                return [wire.streamed_request_body(b"", end=chunk.end_of_stream)]
            else:
                return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        elif kind == "request_trailers":
            answers = [] if self.picked is not None else await self._route(headers_only=False, trailers=True)
            return answers if self.done else [*answers, wire.trailers(response=False)]
        elif kind == "response_headers":
            head = message.response_headers
            added = self.picked.response_headers(wire.header_dict(head.headers), end=head.end_of_stream) \
                if self.picked is not None else {}
            return [wire.response_headers(added)]
        elif kind == "response_body":
            chunk = message.response_body
            if self.picked is not None:
                self.picked.response_body(chunk.body, end=chunk.end_of_stream)
            return [wire.response_body(chunk.body, end=chunk.end_of_stream, streamed=self._response_streamed)]
        elif kind == "response_trailers":
            if self.picked is not None:
                self.picked.response_end()
            return [wire.trailers(response=True)]
        return []

    async def _route(self, *, headers_only: bool, trailers: bool = False) -> list[pb.ProcessingResponse]:
        body = bytes(self._body)
        self._body = bytearray()
        try:
            if not body and self._headers.get(":method", "POST") != "GET":
                raise InvalidRequest("The request has no body: a JSON object is required.")
            picked = self.picked = await self._picking.route(self._headers, body, self._subset)
        except GatewayError as exc:
            self.done = True
            return [error_response(exc)]
        log.debug("request %s -> %s (%s)", picked.ex.request_id, picked.state.name, picked.endpoint)
        duplex = self._request_mode == wire.FULL_DUPLEX_STREAMED
        if headers_only or duplex:
            answers = [wire.routed_headers(picked.endpoint, picked.headers, picked.remove, picked.body)]
            if duplex and not headers_only:
                answers.append(wire.streamed_request_body(picked.body if picked.body is not None else body,
                                                          end=not trailers))
            return answers
        return [wire.routed_body(picked.endpoint, picked.headers, picked.remove, picked.body)]
