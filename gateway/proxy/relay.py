"""Relay an opened backend response to the client: a whole body, or an SSE stream as it arrives.

Nothing here records anything: the relay fills the request's `Exchange` (status, usage, what the
stream measured, the backend's verdict) and accounting reads it once, at the end. Once a stream has
started, a failure ends it with an OpenAI error event and `[DONE]`; it is never retried.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from backends.base import Endpoint, ErrorBody, StreamTranslator, UpstreamFormatError

from .. import json_codec
from ..errors import BackendError, BackendProtocolError, BackendTimeout, BadGateway
from ..observability.outcome import NONE
from ..settings import Timeouts
from ..state.pool import BackendState
from ..tracing.trace import TRACE_ID_HEADER
from .attempts import Opened, map_client_errors
from .deadlines import Deadlines
from .exchange import Exchange
from .request import with_body
from .responses_sse import ResponsesSseRelay
from .sink import ResponseSink
from .sse import SseFramingError, SseRelay, StreamRelay, StreamStats

SSE_CONTENT_TYPE: Final = "text/event-stream; charset=utf-8"
# error types a backend uses for the client's mistakes: an error event of these is not the backend failing
_CLIENT_ERROR_TYPES: Final = frozenset({"invalid_request_error", "BadRequestError", "NotFoundError"})


def response_headers(state: BackendState, ex: Exchange, content_type: str) -> dict[str, str]:
    headers = {
        "Content-Type": content_type,
        "x-gateway-backend": state.name,
        "x-gateway-runtime": state.runtime,
        "x-gateway-route-reason": ex.decision.reason if ex.decision else NONE,
        "x-request-id": ex.request_id,
    }
    if ex.arm is not None:
        headers["x-gateway-arm"] = ex.arm
    if ex.rank is not None:  # the data-parallel rank of the backend it was pinned to
        headers["x-gateway-data-parallel-rank"] = str(ex.rank)
    if ex.ticket is not None:  # what routing expected the engine to serve from its prefix cache
        headers["x-gateway-expected-cached-tokens"] = str(ex.ticket.expected_tokens)
    if ex.rate_headers:
        headers.update(ex.rate_headers)
    if ex.trace is not None:
        headers[TRACE_ID_HEADER] = ex.trace.trace_id_hex
    return headers


def _response_id(body: bytes) -> str | None:
    try:
        obj = json_codec.loads(body)
    except json_codec.JSONDecodeError:
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else None


def ex_stream_relay(ex: Exchange, backend_model: str) -> StreamRelay:
    """The relay that measures (and rewrites) a request's stream; its stats become `ex.stream`."""
    parsed = ex.parsed
    assert parsed is not None
    relay: StreamRelay
    if ex.endpoint is Endpoint.RESPONSES:
        relay = ResponsesSseRelay(backend_model=backend_model, client_model=parsed.model)
    else:
        relay = SseRelay(backend_model=backend_model, client_model=parsed.model,
                         include_usage=parsed.request.include_usage)
    ex.stream = relay.stats
    return relay


def stream_ended(ex: Exchange, stats: StreamStats) -> bool:
    """The verdict on a stream the backend finished sending: an error event is the backend failing
    (unless it is about the client's request); False when it ended before `[DONE]` (the caller
    decides what that is: a broken stream)."""
    if stats.error is not None:
        ex.status = "stream_error"
        ex.verdict = None if stats.error.type in _CLIENT_ERROR_TYPES else False
        return True
    if not stats.done:
        return False
    ex.verdict = True
    return True


class Piped:
    """One stream's per-read step, called by `UpstreamResponse.pipe` as the upstream's bytes arrive:
    translated if the runtime needs it, relayed (measured, model renamed), pushed to the client.
    Returns True when the client is full (the pipe then waits for it)."""

    def __init__(self, relay: StreamRelay, translator: StreamTranslator | None, sink: ResponseSink,
                 clock: Callable[[], float]) -> None:
        self._relay = relay
        self._translator = translator
        self._sink = sink
        self._clock = clock

    def consume(self, data: bytes) -> bool:
        if self._translator is not None:
            data = self._translator.feed(data)
        out = self._relay.feed(data, self._clock())
        return self._sink.push(out) if out else False


class Relay:
    def __init__(
        self, deadlines: Deadlines, *, timeouts: Timeouts, clock: Callable[[], float]
    ) -> None:
        self._deadlines = deadlines
        self._timeouts = timeouts
        self._clock = clock

    def body(self, sink: ResponseSink, opened: Opened, ex: Exchange) -> None:
        state, parsed = opened.state, ex.parsed
        assert parsed is not None
        if ex.trace is not None:  # a sampled request's sink notes the finish reasons
            sink = ex.trace.observe(sink)
        try:
            translated = opened.adapter.translate_response(
                parsed.request, opened.resp.status, opened.first, model=parsed.model, request_id=ex.request_id
            )
        except UpstreamFormatError as exc:
            ex.status, ex.verdict = "502", False
            raise BadGateway(f"The backend's response could not be read: {exc}") from exc
        ex.usage = translated.usage
        if ex.endpoint is Endpoint.RESPONSES:
            ex.response_id = _response_id(translated.body)
        ex.status, ex.verdict = str(opened.resp.status), True
        sink.send(opened.resp.status, response_headers(state, ex, "application/json"), translated.body)

    async def stream(self, sink: ResponseSink, opened: Opened, ex: Exchange) -> None:
        state, parsed = opened.state, ex.parsed
        assert parsed is not None
        if ex.trace is not None:
            sink = ex.trace.observe(sink)
        translator = opened.adapter.stream_translator(parsed.request, model=parsed.model, request_id=ex.request_id)
        backend_model = parsed.model if translator is not None else state.config.model
        relay = ex_stream_relay(ex, backend_model)
        # Nothing reads the request's body from here on (retries and shadows are behind, the
        # translator took what it needs): an open stream no longer holds its prompt, whatever its size.
        ex.parsed = parsed = with_body(parsed, {})

        clock = self._clock
        ex.status = "200"
        headers = response_headers(state, ex, SSE_CONTENT_TYPE)
        out = b""  # what the client gets while nothing is sent yet
        started = False
        failed: bytes | None = None  # the error event that ends a failed stream, written after the handlers
        try:
            try:
                first = translator.feed(opened.first) if translator is not None else opened.first
                out = relay.feed(first, clock())
                if not opened.resp.complete:
                    # More to come: the response head leaves with the first events, in one write.
                    # (A short answer that came whole with the head leaves whole below, in one write.)
                    await sink.start(200, headers, out)
                    started = True
                    remaining = self._timeouts.total_s - (clock() - ex.started)
                    with map_client_errors(state.name), self._deadlines.after(max(remaining, 0.001)):
                        # per read, from the upstream connection's callback: one call into the relay and
                        # one write (a ConnectionError from the write is the client gone: it passes the
                        # error mapping untouched)
                        await opened.resp.pipe(Piped(relay, translator, sink, clock).consume, sink.flush)
                tail = relay.feed(translator.close(), clock()) if translator is not None else b""
                tail += relay.close(clock())
                if not started:
                    out += tail
                elif tail:
                    await sink.write(tail)
                if not stream_ended(ex, relay.stats):
                    raise BackendProtocolError(state.name, "stream ended before [DONE]")
                if isinstance(relay, ResponsesSseRelay):
                    ex.response_id = relay.response_id
            except BackendTimeout:  # the gateway's total deadline, not the backend failing
                ex.status = "stream_timeout"
                failed = relay.error_tail(ErrorBody(
                    message=f"The request exceeded the gateway's total time limit ({self._timeouts.total_s:g} s).",
                    type="server_error", code="timeout"))
            except (BackendError, SseFramingError) as exc:
                ex.status, ex.verdict = "stream_error", False
                detail = exc.detail if isinstance(exc, BackendError) else str(exc)
                failed = relay.error_tail(ErrorBody(
                    message=f"The backend failed mid-stream ({detail}).", type="server_error",
                    code="upstream_stream_error"))
            # (no `await` in an `except` of a compiled module: service.py says why)
            if not started:
                await sink.send_stream(200, headers, out + failed if failed is not None else out)
            else:
                if failed is not None:
                    await sink.write(failed)
                await sink.end()
        except ConnectionError:
            if relay.stats.done and ex.status == "200":  # a client may hang up right after [DONE]: served
                ex.verdict = True
            else:
                ex.status, ex.verdict = "client_closed", None
