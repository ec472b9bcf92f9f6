"""Shadow traffic: a sampled copy of a split route's requests sent to another arm, read to the end
and discarded. Counted apart from client requests (`gateway_shadow_requests_total`), never in any
client-facing metric, never seen by the client.

A shadow request runs in its own task under the gateway's total deadline, is cancelled when its
config generation stops, and closes its routing ticket on every way out (a hung shadow backend can
hold neither a task, a connection nor queued prefill in the latency model past the deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable

from backends.base import Endpoint, UpstreamFormatError, Usage

from ..client import UpstreamClientError
from ..errors import BackendError, GatewayError
from ..observability.metrics import Recorder
from ..observability.outcome import NONE
from ..routing import RoutingState
from ..routing.split import should_shadow
from ..settings import Timeouts
from .attempts import Attempts
from .deadlines import Deadlines
from .exchange import Exchange
from .request import ParsedRequest
from .responses_sse import ResponsesSseRelay
from .routes import RouteState
from .sse import SseFramingError, SseRelay

log = logging.getLogger(__name__)


class Shadows:
    def __init__(
        self, attempts: Attempts, recorder: Recorder, routing: RoutingState, deadlines: Deadlines, *,
        timeouts: Timeouts, clock: Callable[[], float], rng: random.Random,
    ) -> None:
        self._attempts = attempts
        self._recorder = recorder
        self._routing = routing
        self._deadlines = deadlines
        self._timeouts = timeouts
        self._clock = clock
        self._rng = rng
        self.tasks: set[asyncio.Task[None]] = set()

    def maybe(self, route: RouteState, ex: Exchange) -> None:
        """Mirror `ex` to the route's shadow arm if this request is sampled."""
        split = route.split
        shadow = split.shadow if split is not None else None
        if (shadow is None or ex.arm == shadow.arm or ex.ab_excluded is not None
                or not should_shadow(ex.request_id, shadow.fraction, self._rng)):
            return
        if split is not None and not set(ex.capable).intersection(split.arm(shadow.arm).backends):
            return  # the shadow arm cannot serve this request
        # the request as parsed now: once its own stream has started, `ex.parsed` no longer has a body
        assert ex.parsed is not None
        task = asyncio.get_running_loop().create_task(self._run(route, shadow.arm, ex, ex.parsed))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        """Cancel every shadow request still running (shutdown, or the generation retired)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, route: RouteState, arm: str, origin: Exchange, parsed: ParsedRequest) -> None:
        assert route.split is not None
        ex = Exchange(origin.request_id + "-shadow", origin.endpoint, self._clock(), model=origin.model,
                      parsed=parsed, features=origin.features, arm=arm, capable=origin.capable,
                      bridged=origin.bridged, trace=origin.trace.shadow() if origin.trace is not None else None)
        backends = [b for b in route.split.arm(arm).backends if b in origin.capable]
        status = "error"
        usage: Usage | None = None
        try:
            with self._deadlines.after(self._timeouts.total_s):
                opened = await self._attempts.open(route, ex, backends, shadow=True)
                try:
                    body = opened.first + (await opened.resp.read() if parsed.request.stream else b"")
                finally:
                    opened.resp.close()
                    opened.release()
            status = str(opened.resp.status)
            state = opened.state
            if not parsed.request.stream:
                usage = opened.adapter.translate_response(
                    parsed.request, opened.resp.status, body, model=parsed.model, request_id=ex.request_id
                ).usage
            else:
                relay: SseRelay | ResponsesSseRelay = (
                    ResponsesSseRelay(backend_model=state.config.model, client_model=parsed.model)
                    if ex.endpoint is Endpoint.RESPONSES
                    else SseRelay(backend_model=state.config.model, client_model=parsed.model, include_usage=True))
                translator = opened.adapter.stream_translator(parsed.request, model=parsed.model,
                                                              request_id=ex.request_id)
                data = translator.feed(body) + translator.close() if translator is not None else body
                now = self._clock()
                relay.feed(data, now)
                relay.close(now)
                usage = relay.stats.usage
        except (GatewayError, BackendError, UpstreamFormatError, UpstreamClientError, SseFramingError,
                TimeoutError) as exc:
            log.debug("shadow request %s failed: %s", ex.request_id, exc)
        finally:
            if ex.ticket is not None:  # the engine cached this prompt too: keep the routing memory true
                if usage is not None:
                    self._routing.completed(ex.ticket, cached_tokens=usage.cached_tokens,
                                            prompt_tokens=usage.prompt_tokens, itl_s=None)
                else:
                    self._routing.failed(ex.ticket, reached_engine=True)
                ex.ticket = None
            self._recorder.shadow(origin.model, ex.arm or NONE, status, usage)
            if ex.trace is not None:
                ex.trace.finish_shadow(status)
