"""One request's trace, as the request path sees it: a handle with one method per step.

The request path holds a `Trace` only when tracing is on (`Exchange.trace is None` otherwise: a
branch, nothing else). This base class is what a request that is not sampled gets: every step is a
no-op except the two that are not about recording, its trace id (`x-trace-id`, the access log) and
the `traceparent` it passes upstream with the sampled flag off (so the engine does not record it
either; a caller's span id is passed through, as a non-recording hop should). A sampled request gets
`sampled.Sampled`, which records the spans. Neither imports the OpenTelemetry SDK: this module is
imported by the compiled request path, the SDK only when tracing is on (`tracer.py`).

The steps, in the order a request takes them (each called from outside the HTTP fronts too, e.g.
by a gRPC endpoint picker: they take plain values of the rooms below the proxy):

- `parsed(model, request)`: the request's model and parameters are known (the span gets its name);
- `routing()` then `routed(...)`: one routing decision, a child span per decision;
- `attempt(state, headers, upstream_id)`: one CLIENT span per upstream attempt; returns the headers
  to send, with `traceparent`/`tracestate`. `attempt_failed(error)` ends it (retries are siblings);
  the attempt that opened a response ends with the request;
- `leg(role, state, headers, upstream_id) -> Leg`: a CLIENT span for one leg of a disaggregated
  request (prefill, decode), child of the request's span; send `leg.headers`, call `leg.end(...)`;
- `observe(sink)`: the response sink, watched for finish reasons and the response id when sampled;
- `shadow()`: the trace of a shadow copy (its attempts are marked `gateway.shadow`), ended by
  `finish_shadow(status)`;
- `finish(outcome, state)`: the request is recorded (accounting); every open span ends.

A leg of a disaggregated request (`gateway.leg` = prefill or decode; tested in
`tests/unit/tracing/test_api.py`), from the code that sends it:

    leg = ex.trace.leg("prefill", state, upstream.headers, upstream_id) if ex.trace is not None else None
    headers = upstream.headers if leg is None else leg.headers   # what goes upstream
    try:
        resp = await pool.request(state.base_url, "POST", upstream.path, headers, upstream.body)
    except BaseException as failure:
        if leg is not None:
            leg.end(failure)                                     # error.type, status ERROR
        raise
    if leg is not None:
        leg.end(status=resp.status)
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Final, Protocol

from backends.base import ClientRequest, Endpoint

from ..observability.outcome import Outcome
from ..routing import Decision, SlaTarget
from ..state.pool import BackendState
from .context import TRACEPARENT, TRACESTATE, Parent, format_traceparent, trace_id_hex
from .observe import Sink

TRACE_ID_HEADER: Final = "x-trace-id"  # every traced response says its trace id (errors too)
_ids: Final = random.Random()  # ids need uniqueness, not secrecy (the SDK's RandomIdGenerator does the same)


def new_span_id() -> int:
    return _ids.getrandbits(64) or 1


def new_trace_id() -> int:
    return _ids.getrandbits(128) or 1


class Leg:
    """One upstream call's span (an attempt, or a leg of a disaggregated request): what to send, and
    its end. The base records nothing (an unsampled request)."""

    __slots__ = ("headers",)

    def __init__(self, headers: Mapping[str, str]) -> None:
        self.headers = headers

    def end(self, error: BaseException | None = None, *, status: int | None = None) -> None:
        """The call is over: `error` when it failed (its `error.type`), else `status` if known."""
        return None


class Trace:
    """An unsampled request's trace (see the module docstring); `Sampled` records."""

    __slots__ = ("_traceparent", "parent", "trace_id", "trace_id_hex")
    sampled = False

    def __init__(self, trace_id: int, parent: Parent | None) -> None:
        self.trace_id = trace_id
        self.trace_id_hex = trace_id_hex(trace_id)
        self.parent = parent
        self._traceparent: str | None = None

    def _upstream(self, headers: Mapping[str, str]) -> dict[str, str]:
        value = self._traceparent
        if value is None:
            parent = self.parent
            span_id = parent.span_id if parent is not None else new_span_id()
            value = self._traceparent = format_traceparent(self.trace_id, span_id, False)
        out = {**headers, TRACEPARENT: value}
        parent = self.parent
        if parent is not None and parent.tracestate:
            out[TRACESTATE] = parent.tracestate
        return out

    def parsed(self, model: str, request: ClientRequest) -> None:
        return None

    def routing(self) -> None:
        return None

    def routed(self, policy: str, candidates: Sequence[str], decision: Decision, *, arm: str | None,
               ab_excluded: str | None, sla: SlaTarget | None) -> None:
        return None

    def attempt(self, state: BackendState, headers: Mapping[str, str], upstream_id: str) -> Mapping[str, str]:
        return self._upstream(headers)

    def attempt_failed(self, error: BaseException) -> None:
        return None

    def leg(self, role: str, state: BackendState, headers: Mapping[str, str], upstream_id: str) -> Leg:
        return Leg(self._upstream(headers))

    def observe(self, sink: Sink) -> Sink:
        return sink

    def shadow(self) -> Trace:
        return self

    def finish_shadow(self, status: str) -> None:
        return None

    def finish(self, outcome: Outcome, state: BackendState | None) -> None:
        return None


class Tracing(Protocol):
    """Where a request's trace starts (`tracer.Tracer`): given the request's headers (any mapping
    with `get`: HTTP headers, gRPC metadata), its endpoint and id."""

    def start(self, headers: Mapping[str, str], endpoint: Endpoint, request_id: str) -> Trace: ...
