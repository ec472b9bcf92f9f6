"""The HTTP server below aiohttp's handlers: header read timeout and OpenAI-shaped parser errors.

aiohttp's server has a keep-alive timeout but no limit on how long a client may take to send a
request's headers (slowloris), and its HTTP parser answers bad requests and oversized headers in
plain text. `GatewayProtocol` arms a timer when a request's first bytes arrive and answers 408 (OpenAI
JSON) and closes the connection when its headers are not complete in `header_timeout_s`; parser
errors become OpenAI JSON (431 for an oversized line or header). Written against aiohttp 3.14
(`web_protocol.RequestHandler`); tests/integration/test_bad_input.py pins both behaviours.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler

from ..errors import GatewayError, RequestTimeout

_TYPES = {431: "invalid_request_error", 400: "invalid_request_error", 500: "server_error"}


def _raw_response(error: GatewayError) -> bytes:
    body = error.render()
    reason = {408: "Request Timeout"}.get(error.status, "Error")
    head = (f"HTTP/1.1 {error.status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class GatewayProtocol(RequestHandler):
    __slots__ = ("_header_timeout_s", "_header_timer")

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        before = self._request_count
        super().data_received(data)
        if self._request_count > before:  # a request's headers are complete
            self._disarm()
        elif self._header_timer is None and self._current_request is None and not self._messages:
            loop = asyncio.get_running_loop()
            self._header_timer = loop.call_later(self._header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._current_request is not None or self._messages or self.transport is None:
            return  # the headers did arrive (a body was still streaming in): not our business
        error = RequestTimeout("The request headers were not received in time.")
        self.transport.write(_raw_response(error))
        self.force_close()
        self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs, and raises if a response started
        if isinstance(exc, LineTooLong):
            status, message = 431, f"Request header fields too large: {exc.message}"
        text = message if status != 500 and message else "The gateway failed to handle the request."
        error = GatewayError(text)
        error.status = status
        error.type = _TYPES.get(status, "invalid_request_error")
        response = web.Response(status=status, body=error.render(), content_type="application/json")
        response.force_close()
        return response


class GatewayServer(web.Server):
    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s

    def __call__(self) -> RequestHandler:
        return GatewayProtocol(self, loop=self._loop, header_timeout_s=self._header_timeout_s, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An AppRunner whose connections are GatewayProtocol instances."""

    __slots__ = ("_header_timeout_s",)

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()
        return GatewayServer(
            base.request_handler, request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation, loop=base._loop,
            header_timeout_s=self._header_timeout_s, **base._kwargs,
        )
