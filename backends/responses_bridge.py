"""Serve a Responses request on a backend that only speaks chat completions: an adapter around the
backend's own adapter. Pure, like every adapter.

The request becomes a chat request (`responses_chat.to_chat`), which the backend's adapter builds as
it builds any chat request (Triton's renders it through its chat template); the answer comes back
through that adapter (Triton's becomes OpenAI chat) and is then turned into a Response object, or,
streamed, into Responses events (`responses_stream`). Everything else is the inner adapter's.
"""

from __future__ import annotations

from typing import Any

import orjson

from backends.base import (
    ClientRequest,
    Endpoint,
    Reply,
    StreamTranslator,
    UpstreamFormatError,
    UpstreamRequest,
)
from backends.delegating import DelegatingAdapter
from backends.responses_chat import from_chat, to_chat
from backends.responses_stream import ChatToResponsesStream


def chat_request(req: ClientRequest) -> ClientRequest:
    """The chat request standing for a Responses request. Raises TranslationError."""
    return ClientRequest(endpoint=Endpoint.CHAT, body=to_chat(req.body), stream=req.stream, include_usage=True,
                         created=req.created)


class ResponsesBridge(DelegatingAdapter):
    """`inner`'s adapter, with Responses requests served as chat (other endpoints pass through)."""

    def build_request(self, req: ClientRequest, *, model: str, request_id: str) -> UpstreamRequest:
        if req.endpoint is not Endpoint.RESPONSES:
            return self._inner.build_request(req, model=model, request_id=request_id)
        return self._inner.build_request(chat_request(req), model=model, request_id=request_id)

    def stream_translator(self, req: ClientRequest, *, model: str, request_id: str) -> StreamTranslator | None:
        if req.endpoint is not Endpoint.RESPONSES:
            return self._inner.stream_translator(req, model=model, request_id=request_id)
        inner = self._inner.stream_translator(chat_request(req), model=model, request_id=request_id)
        return ChatToResponsesStream(inner, req.body, model=model, request_id=request_id, created=req.created or 0)

    def translate_response(
        self, req: ClientRequest, status: int, body: bytes, *, model: str, request_id: str
    ) -> Reply:
        if req.endpoint is not Endpoint.RESPONSES:
            return self._inner.translate_response(req, status, body, model=model, request_id=request_id)
        chat = self._inner.translate_response(chat_request(req), status, body, model=model, request_id=request_id)
        try:
            obj: Any = orjson.loads(chat.body)
        except orjson.JSONDecodeError as exc:
            raise UpstreamFormatError(f"chat answer is not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise UpstreamFormatError("chat answer is not a JSON object")
        response = from_chat(obj, req.body, request_id=request_id, created=req.created or 0, model=model,
                             usage=chat.usage)
        return Reply(orjson.dumps(response), chat.usage)
