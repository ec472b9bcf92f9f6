"""The entry every HTTP front calls for a generation request (`sink.Entry`): authenticate, rate-limit,
parse once, serve on the current config generation, and record it exactly once in a `finally`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from backends.base import Endpoint

from ..access.auth import Guard
from ..errors import GatewayError
from ..state.generations import Generations
from ..tracing.trace import TRACE_ID_HEADER, Tracing
from .accounting import Accounting
from .exchange import Exchange
from .service import proxy_of
from .sink import ResponseSink


class Dispatcher:
    def __init__(
        self, generations: Generations, guard: Guard, accounting: Accounting, *, clock: Callable[[], float],
        tracing: Tracing | None = None,
    ) -> None:
        self._generations = generations
        self._guard = guard
        self._accounting = accounting
        self._clock = clock
        self._tracing = tracing

    async def dispatch(
        self, headers: Mapping[str, str], body: bytes, endpoint: Endpoint, sink: ResponseSink, request_id: str
    ) -> None:
        """Serve one generation request on the generation current when it arrived (held until its
        response, stream included, is finished)."""
        generation = self._generations.enter()
        ex = Exchange(request_id, endpoint, self._clock())
        tracing = self._tracing
        trace = ex.trace = tracing.start(headers, endpoint, request_id) if tracing is not None else None
        try:
            key = ex.key = self._guard.authenticate(headers)
            if key is not None:
                ex.rate_headers = await self._guard.limit(key) or None
            proxy = proxy_of(generation)
            proxy.parse(ex, body, headers)
            body = b""  # parsed: the bytes are not kept for the life of a stream
            if trace is not None:
                assert ex.parsed is not None
                trace.parsed(ex.model, ex.parsed.request)
            await proxy.serve(ex, headers, sink)
        except GatewayError as exc:
            ex.status = str(exc.status)
            if ex.rate_headers:  # the key's budgets go with every answer, errors included
                exc.headers = {**ex.rate_headers, **exc.headers}
            if trace is not None:
                exc.headers = {**exc.headers, TRACE_ID_HEADER: trace.trace_id_hex}
            raise
        except (asyncio.CancelledError, ConnectionError):
            stream = ex.stream
            if not (stream is not None and stream.done and ex.status == "200"):  # gone after [DONE]: served
                ex.status = "client_closed"
            raise
        except Exception:  # a bug: never recorded as the status the response had before it broke
            ex.status = "stream_error" if ex.stream is not None and ex.status == "200" else "500"
            raise
        finally:
            self._accounting.finish(ex)
            self._generations.leave(generation)

    def refused(self, endpoint: Endpoint, status: int | str, request_id: str | None) -> None:
        self._accounting.finish(Exchange(request_id or "", endpoint, self._clock(), status=str(status)))
