"""aiohttp's server behind our reader: the same limits, timeouts and refusals as the native front.

aiohttp's server has no limit on how long a client may take to send a request's head (slowloris), no
limit on a head's total size, answers parser errors in plain text, and closes a connection whose
client shut down its sending side before the response is written. `GatewayProtocol` reads every
byte with `reader.Reader` (the native front's reader) before aiohttp's parser sees it, and gives
aiohttp only the requests the reader accepted:

- a head that is not complete `header_timeout_s` after its first byte: 408, closed;
- an oversized request line, header field or head (431), unparseable input (400), a body over the
  limit (413): answered in OpenAI's shape once the earlier requests on the connection are answered,
  then closed; the refused request never reaches aiohttp;
- each of these is reported to `refused` when its request line named a generation endpoint, so that
  every generation request is counted once (the handlers count the body timeout and 413s aiohttp
  finds itself; `handle_error` counts whatever aiohttp's own parser refuses that ours accepted);
- a half-close: the requests already sent are answered, then the connection closes.

Only aiohttp's public surface is used: `web.RequestHandler` and `web.Server` subclassed through their
public methods (`data_received`, `eof_received`, `handle_error`, `log_access`, `close`,
`force_close`, `transport`, `web.Server.__call__`), the runner's public `server`. aiohttp's own
limits are set above ours (`aiohttp_limits`), so that ours decide.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from backends.base import Endpoint

from ..errors import GatewayError, HeadersTooLarge, RequestTimeout
from ..proxy.exchange import request_id as choose_request_id
from ..settings import Limits
from .halfclose import PROBE, GoneWatch
from .reader import FAILED, MAX_HEADERS, Message, Reader
from .wire import error_bytes

Refused = Callable[[Endpoint, int, "str | None"], None]

GENERATION_PATHS = {
    b"/v1/chat/completions": Endpoint.CHAT, b"/v1/completions": Endpoint.COMPLETIONS,
    b"/v1/responses": Endpoint.RESPONSES, b"/v1/embeddings": Endpoint.EMBEDDINGS,
    b"/tokenize": Endpoint.TOKENIZE, b"/detokenize": Endpoint.DETOKENIZE,
}
_TYPES = {431: "invalid_request_error", 400: "invalid_request_error", 500: "server_error"}


def generation_endpoint(msg: Message | None) -> Endpoint | None:
    """The generation endpoint a request line named (query ignored, as aiohttp's router does)."""
    if msg is None or msg.method != b"POST":
        return None
    return GENERATION_PATHS.get(msg.url.partition(b"?")[0])


def aiohttp_limits(limits: Limits) -> dict[str, int]:
    """aiohttp's own parser limits, a margin above ours: `Reader` refuses first, in OpenAI's shape
    and counted; aiohttp's are a backstop (its line limit counts `name: value`, ours name and value)."""
    return {"max_line_size": limits.max_header_bytes + 64, "max_field_size": limits.max_header_bytes + 64,
            "max_headers": MAX_HEADERS + 1}


class GatewayProtocol(web.RequestHandler):
    """One connection aiohttp serves, every byte read first by our `Reader` (see the module doc).

    Counts kept to order what we write among aiohttp's responses: `reader.heads` requests reached
    aiohttp, `_gw_answered` of them are answered (`log_access`), `_gw_prepared` had their head sent."""

    __slots__ = ("_gw_answered", "_gw_eof", "_gw_given", "_gw_header_timeout_s", "_gw_loop", "_gw_prepared",
                 "_gw_reader", "_gw_refusal", "_gw_refused", "_gw_timer", "_gw_wait_for", "_gw_watch")

    def __init__(
        self, manager: web.Server, *, loop: asyncio.AbstractEventLoop, limits: Limits, refused: Refused,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._gw_loop = loop
        self._gw_reader = Reader(limits, keep_body=False)
        self._gw_header_timeout_s = limits.header_timeout_s
        self._gw_refused = refused
        self._gw_timer: asyncio.TimerHandle | None = None
        self._gw_answered = 0  # responses aiohttp finished (`log_access`)
        self._gw_prepared = 0  # responses whose head aiohttp sent (`track_responses`)
        self._gw_eof = False
        self._gw_watch: GoneWatch | None = None  # after a FIN during a request: has the client gone?
        # a refusal waits for the `_gw_wait_for` requests before it to be answered; `_gw_given`: the
        # refused request's head had already reached aiohttp (its body was refused)
        self._gw_refusal: bytes | None = None
        self._gw_wait_for = 0
        self._gw_given = False

    def data_received(self, data: bytes) -> None:
        reader = self._gw_reader
        if reader.closed:
            return  # refused, or after a request without keep-alive (aiohttp closes after it)
        head_given = reader.message is not None and reader.message.headers_done
        began_here = False
        start = 0  # where, in `data`, the request being read began (0: here, or in an earlier read)
        pos, n = 0, len(data)
        while pos < n and not reader.closed:
            if reader.message is None:
                start, began_here = pos, True
            pos = reader.feed(data, pos)
            if reader.event == FAILED:
                msg = reader.message
                if start:
                    super().data_received(data[:start])  # the requests before the refused one
                done_heads = reader.heads - (1 if msg is not None and msg.headers_done else 0)
                error = reader.error
                assert error is not None
                self._gw_refuse(error, msg, wait_for=done_heads, given=head_given and not began_here)
                return
        super().data_received(data if pos >= n else data[:pos])  # not what follows a Connection: close
        msg = reader.message
        if msg is not None and not msg.headers_done:
            if self._gw_timer is None:
                self._gw_timer = self._gw_loop.call_later(self._gw_header_timeout_s, self._gw_headers_too_slow)
        else:
            self._gw_disarm()

    def eof_received(self) -> bool:  # type: ignore[override]  # asyncio's contract: True keeps it open
        """A half-close: answer the requests already sent, then close (aiohttp alone closes at once)."""
        if self._gw_eof:
            return True  # uvloop may report the end of the stream more than once
        self._gw_eof = True
        reader = self._gw_reader
        if self._gw_refusal is not None:
            return True  # it is answered, and the connection closed, once its turn comes
        msg = reader.message
        if (msg is not None and msg.headers_done) or self._gw_answered >= reader.heads:
            self.force_close()  # a body that will never come, or nothing left to answer
        elif self.transport is not None:
            last = reader.last
            probe = (self._gw_prepared == self._gw_answered == reader.heads - 1  # one to answer, not begun
                     and last is not None and last.http11)
            # (a stream already started is not probed here: it learns at its next write)
            self._gw_watch = GoneWatch(self._gw_loop, self.transport, self._gw_gone, probe=PROBE if probe else b"")
        return True

    def response_started(self) -> None:
        self._gw_prepared += 1

    def _gw_gone(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # as if the connection was lost: the running handler is cancelled

    def log_access(self, request: web.BaseRequest, response: web.StreamResponse, time: float | None) -> None:
        super().log_access(request, response, time)
        self._gw_answered += 1
        if self._gw_refusal is not None:
            if self._gw_answered >= self._gw_wait_for:
                self._gw_answer_refusal()
        elif self._gw_eof and self._gw_answered >= self._gw_reader.heads:
            self._gw_stop_watch()
            self.close()  # aiohttp closes once this response is written

    def connection_lost(self, exc: BaseException | None) -> None:
        self._gw_disarm()
        self._gw_stop_watch()
        super().connection_lost(exc)

    def _gw_stop_watch(self) -> None:
        if self._gw_watch is not None:
            self._gw_watch.stop()
            self._gw_watch = None

    def _gw_disarm(self) -> None:
        if self._gw_timer is not None:
            self._gw_timer.cancel()
            self._gw_timer = None

    def _gw_headers_too_slow(self) -> None:
        self._gw_timer = None
        reader = self._gw_reader
        msg = reader.message
        if msg is None or msg.headers_done or reader.closed or self.transport is None:
            return
        if self._gw_answered < reader.heads:  # behind a response still running: it waits its turn
            self._gw_timer = self._gw_loop.call_later(self._gw_header_timeout_s, self._gw_headers_too_slow)
            return
        reader.closed = True
        self._gw_refuse(RequestTimeout("The request headers were not received in time."), msg,
                        wait_for=reader.heads, given=False)

    def _gw_refuse(self, error: GatewayError, msg: Message | None, *, wait_for: int, given: bool) -> None:
        """Count the refusal (once) and answer it when the requests before it have been answered."""
        self._gw_disarm()
        endpoint = generation_endpoint(msg)
        request_id = None
        if endpoint is not None:
            assert msg is not None
            request_id = choose_request_id(msg.headers.get("x-request-id"))
            self._gw_refused(endpoint, error.status, request_id)
        self._gw_refusal, self._gw_wait_for, self._gw_given = error_bytes(error, request_id), wait_for, given
        if self._gw_answered >= wait_for:
            self._gw_answer_refusal()

    def _gw_answer_refusal(self) -> None:
        refusal = self._gw_refusal
        transport = self.transport
        if refusal is None or transport is None:
            return
        self._gw_refusal = None
        if not (self._gw_given and self._gw_answered > self._gw_wait_for):  # aiohttp answered it itself
            transport.write(refusal)
        self.force_close()  # a handler still waiting for the refused body is cancelled

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs, and raises if a response started
        if isinstance(exc, LineTooLong):
            status, message = 431, f"Request header fields too large: {exc.message}"
        if isinstance(exc, HttpProcessingError):  # aiohttp's parser refused what ours accepted
            endpoint = generation_endpoint(self._gw_reader.message or self._gw_reader.last)
            if endpoint is not None:
                self._gw_refused(endpoint, status, None)
        text = message if status != 500 and message else "The gateway failed to handle the request."
        error = HeadersTooLarge(text) if status == 431 else GatewayError(text)
        error.status = status
        error.type = _TYPES.get(status, "invalid_request_error")
        response = web.Response(status=status, body=error.render(), content_type="application/json")
        response.force_close()
        return response


def track_responses(app: web.Application) -> None:
    """Tell each connection's `GatewayProtocol` when a response's head goes out (before `app` starts):
    a half-closed connection is probed only while its response has not begun."""

    async def started(request: web.Request, response: web.StreamResponse) -> None:
        protocol = request.protocol
        if isinstance(protocol, GatewayProtocol):
            protocol.response_started()

    app.on_response_prepare.append(started)


class GatewayServer(web.Server):
    """aiohttp's protocol factory, making `GatewayProtocol`s for the runner's application."""

    def __init__(
        self, runner: web.AppRunner, *, limits: Limits, refused: Refused, **kwargs: Any
    ) -> None:
        base = runner.server
        assert base is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        super().__init__(base.request_handler, request_factory=base.request_factory, loop=loop,
                         handler_cancellation=True)
        self._gw_loop = loop
        self._gw_limits = limits
        self._gw_refused = refused
        self._gw_kwargs = {**aiohttp_limits(limits), **kwargs}

    def __call__(self) -> GatewayProtocol:
        return GatewayProtocol(self, loop=self._gw_loop, limits=self._gw_limits, refused=self._gw_refused,
                               **self._gw_kwargs)
