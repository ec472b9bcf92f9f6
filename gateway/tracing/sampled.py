"""A sampled request's spans, recorded with the OpenTelemetry SDK (`trace.Trace` says what each step is).

    SERVER  `{operation} {route model}`            the client's request, child of its `traceparent`
      INTERNAL `route`                              one per routing decision
      CLIENT   `{operation} {backend model}`        one per upstream attempt (retries are siblings),
                                                    shadow copies marked `gateway.shadow`, P/D legs
                                                    marked `gateway.leg`; the engine's own span
                                                    (vLLM's `llm_request`, ...) is its child

Spans are started with explicit parents (no context variables: nothing here depends on which task
runs), and their attributes are set in as few calls as possible. Every name is in `semconv`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    TraceState,
    set_span_in_context,
)

from backends.base import ClientRequest, Endpoint

from ..errors import BackendConnectError, BackendError, BackendTimeout, GatewayError
from ..observability.outcome import Outcome
from ..routing import Decision, SlaTarget
from ..state.pool import BackendState
from . import semconv as sc
from .context import TRACEPARENT, TRACESTATE, Parent, format_traceparent
from .observe import Observed, Seen, Sink
from .trace import Leg, Trace

Throughput = Callable[[str], float | None]
_ABNORMAL = frozenset({"stream_error", "stream_timeout", "client_closed"})


def request_cost_usd(usd_per_hour: float | None, output_tokens: int, tokens_per_s: float | None) -> float | None:
    """What a request cost on its backend: the backend's price for the time its output tokens take
    at the backend's measured throughput (its share of the hour it is paid for), or None when the
    price or the throughput is unknown."""
    if usd_per_hour is None or not tokens_per_s or tokens_per_s <= 0:
        return None
    return usd_per_hour / 3600.0 * output_tokens / tokens_per_s


def error_type(error: BaseException) -> str:
    """`error.type`: the backend's status where it answered one, else a low-cardinality class name."""
    if isinstance(error, BackendTimeout):
        return "timeout"
    if isinstance(error, BackendConnectError):
        return "connect_error"
    status = getattr(error, "status", None)
    if isinstance(error, BackendError | GatewayError) and isinstance(status, int):
        return str(status)
    return type(error).__name__


def _server(state: BackendState) -> dict[str, Any]:
    url = state.config.url
    attrs: dict[str, Any] = {sc.SERVER_ADDRESS: url.host or "", sc.GATEWAY_BACKEND: state.name,
                             sc.GATEWAY_RUNTIME: str(state.runtime), sc.GEN_AI_PROVIDER_NAME: str(state.runtime)}
    if url.port is not None:
        attrs[sc.SERVER_PORT] = url.port
    return attrs


def request_attributes(request: ClientRequest, names: sc.Names) -> dict[str, Any]:
    """The GenAI request parameters a client sent (only those present)."""
    body = request.body
    attrs: dict[str, Any] = {}
    if request.stream:
        attrs[sc.GEN_AI_REQUEST_STREAM] = True
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        attrs[sc.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
    for key, name in (("temperature", sc.GEN_AI_REQUEST_TEMPERATURE), ("top_p", sc.GEN_AI_REQUEST_TOP_P)):
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attrs[name] = float(value)
    top_k = body.get("top_k")
    if isinstance(top_k, int | float) and not isinstance(top_k, bool):
        attrs[sc.GEN_AI_REQUEST_TOP_K] = int(top_k) if names.latest else float(top_k)
    seed, n = body.get("seed"), body.get("n")
    if isinstance(seed, int) and not isinstance(seed, bool):
        attrs[sc.GEN_AI_REQUEST_SEED] = seed
    if isinstance(n, int) and not isinstance(n, bool) and n != 1:
        attrs[sc.GEN_AI_REQUEST_CHOICE_COUNT] = n
    if names.latest:
        previous = body.get("previous_response_id")
        if isinstance(previous, str):
            attrs[sc.GEN_AI_REQUEST_PREVIOUS_RESPONSE_ID] = previous
        reasoning = body.get("reasoning")
        effort = body.get("reasoning_effort", reasoning.get("effort") if isinstance(reasoning, dict) else None)
        if isinstance(effort, str):
            attrs[sc.GEN_AI_REQUEST_REASONING_LEVEL] = effort
    return attrs


def usage_attributes(outcome: Outcome, names: sc.Names) -> dict[str, Any]:
    usage = outcome.usage
    if usage is None:
        return {}
    attrs: dict[str, Any] = {sc.GEN_AI_USAGE_INPUT_TOKENS: usage.prompt_tokens,
                             sc.GEN_AI_USAGE_OUTPUT_TOKENS: usage.completion_tokens}
    if usage.cached_tokens is not None:
        attrs[sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = usage.cached_tokens
    if outcome.usage_estimated:
        attrs[sc.GATEWAY_USAGE_ESTIMATED] = True
    return attrs


class SampledLeg(Leg):
    __slots__ = ("_span",)

    def __init__(self, span: Span, headers: Mapping[str, str]) -> None:
        super().__init__(headers)
        self._span = span

    def end(self, error: BaseException | None = None, *, status: int | None = None) -> None:
        span = self._span
        if not span.is_recording():
            return  # ended already
        if error is not None:
            kind = error_type(error)
            span.set_attribute(sc.ERROR_TYPE, kind)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:256]))
        if status is not None:
            span.set_attribute(sc.HTTP_RESPONSE_STATUS_CODE, status)
        span.end()


class Sampled(Trace):
    """A sampled request: its SERVER span, and the spans of its steps as they happen."""

    __slots__ = ("_attempt", "_attempts", "_ctx", "_endpoint", "_model", "_names", "_operation", "_route_began",
                 "_seen", "_shadow", "_span", "_throughput", "_tracer")
    sampled = True

    def __init__(
        self, tracer: Tracer, trace_id: int, parent: Parent | None, *, endpoint: Endpoint, request_id: str,
        names: sc.Names, throughput: Throughput,
    ) -> None:
        super().__init__(trace_id, parent)
        self._tracer = tracer
        self._names = names
        self._throughput = throughput
        self._endpoint = endpoint
        self._operation = sc.OPERATIONS[endpoint]
        self._model: str | None = None
        self._attempt: SampledLeg | None = None
        self._attempts = 0
        self._route_began = 0
        self._seen: Seen | None = None
        self._shadow = False
        parent_ctx: Context | None = None
        if parent is not None:
            state = TraceState.from_header([parent.tracestate]) if parent.tracestate else None
            remote = SpanContext(parent.trace_id, parent.span_id, is_remote=True,
                                 trace_flags=TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT),
                                 trace_state=state)
            parent_ctx = set_span_in_context(NonRecordingSpan(remote))
        self._span = tracer.start_span(self._operation, context=parent_ctx, kind=SpanKind.SERVER, attributes={
            sc.GEN_AI_OPERATION_NAME: self._operation, sc.GATEWAY_ENDPOINT: endpoint.value,
            sc.GATEWAY_REQUEST_ID: request_id,
        })
        self._ctx = set_span_in_context(self._span)

    # -- the request ------------------------------------------------------------------------------

    def parsed(self, model: str, request: ClientRequest) -> None:
        self._model = model
        span = self._span
        span.update_name(sc.span_name(self._operation, model))
        span.set_attributes({sc.GEN_AI_REQUEST_MODEL: model, **request_attributes(request, self._names)})

    def routing(self) -> None:
        self._route_began = time.time_ns()

    def routed(self, policy: str, candidates: Sequence[str], decision: Decision, *, arm: str | None,
               ab_excluded: str | None, sla: SlaTarget | None) -> None:
        attrs: dict[str, Any] = {
            sc.GATEWAY_ROUTING_POLICY: policy, sc.GATEWAY_ROUTING_REASON: decision.reason,
            sc.GATEWAY_ROUTING_CANDIDATES: list(candidates), sc.GATEWAY_ROUTING_CHOSEN: decision.backend,
            sc.GATEWAY_ROUTING_EXPECTED_CACHED_TOKENS: decision.expected_hit_tokens,
        }
        if decision.predicted_ttft_s is not None:
            attrs[sc.GATEWAY_ROUTING_PREDICTED_TTFT] = decision.predicted_ttft_s
        if arm is not None:
            attrs[sc.GATEWAY_AB_ARM] = arm
        if ab_excluded is not None:
            attrs[sc.GATEWAY_AB_EXCLUDED] = ab_excluded
        if sla is not None:
            if sla.ttft_s is not None:
                attrs[sc.GATEWAY_SLA_TTFT] = sla.ttft_s
            if sla.tpot_s is not None:
                attrs[sc.GATEWAY_SLA_TPOT] = sla.tpot_s
            attrs[sc.GATEWAY_SLA_VERDICT] = ("rejected" if decision.reject else
                                             "predicted_miss" if decision.reason == "sla_miss" else "predicted_met")
        if self._shadow:
            attrs[sc.GATEWAY_SHADOW] = True
        began = self._route_began or None
        self._tracer.start_span(sc.ROUTE_SPAN, context=self._ctx, kind=SpanKind.INTERNAL, attributes=attrs,
                                start_time=began).end()
        self._route_began = 0

    # -- upstream calls ---------------------------------------------------------------------------

    def _call(self, state: BackendState, headers: Mapping[str, str], upstream_id: str,
              extra: Mapping[str, Any]) -> SampledLeg:
        attrs = {sc.GEN_AI_OPERATION_NAME: self._operation, sc.GEN_AI_REQUEST_MODEL: state.config.model,
                 sc.GATEWAY_UPSTREAM_REQUEST_ID: upstream_id, **_server(state), **extra}
        span = self._tracer.start_span(sc.span_name(self._operation, state.config.model), context=self._ctx,
                                       kind=SpanKind.CLIENT, attributes=attrs)
        ctx = span.get_span_context()
        out = {**headers, TRACEPARENT: format_traceparent(ctx.trace_id, ctx.span_id, True)}
        if ctx.trace_state:
            out[TRACESTATE] = ctx.trace_state.to_header()
        return SampledLeg(span, out)

    def attempt(self, state: BackendState, headers: Mapping[str, str], upstream_id: str) -> Mapping[str, str]:
        self._attempts += 1
        extra: dict[str, Any] = {sc.GATEWAY_ATTEMPT: self._attempts}
        if self._shadow:
            extra[sc.GATEWAY_SHADOW] = True
        leg = self._attempt = self._call(state, headers, upstream_id, extra)
        return leg.headers

    def attempt_failed(self, error: BaseException) -> None:
        leg, self._attempt = self._attempt, None
        if leg is not None:
            leg.end(error)

    def leg(self, role: str, state: BackendState, headers: Mapping[str, str], upstream_id: str) -> Leg:
        return self._call(state, headers, upstream_id, {sc.GATEWAY_LEG: role})

    def observe(self, sink: Sink) -> Sink:
        seen = self._seen = Seen()
        return Observed(sink, seen)

    # -- the end ----------------------------------------------------------------------------------

    def shadow(self) -> Trace:
        """The trace of this request's shadow copy: its spans are children of this request's span."""
        twin = copy.copy(self)
        twin._traceparent, twin._attempt, twin._attempts, twin._route_began = None, None, 0, 0
        twin._seen, twin._shadow = None, True
        return twin

    def finish_shadow(self, status: str) -> None:
        leg, self._attempt = self._attempt, None
        if leg is not None:
            leg.end(None, status=int(status) if status.isdigit() else None)

    def finish(self, outcome: Outcome, state: BackendState | None) -> None:
        status = outcome.status
        failed = not status.startswith("2")
        attrs: dict[str, Any] = {sc.GATEWAY_STATUS: status, sc.GATEWAY_RETRIES: max(self._attempts - 1, 0),
                                 **usage_attributes(outcome, self._names)}
        if status.isdigit():
            attrs[sc.HTTP_RESPONSE_STATUS_CODE] = int(status)
        if failed:
            attrs[sc.ERROR_TYPE] = status
        if outcome.ttft_s is not None:
            attrs[sc.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = outcome.ttft_s
        if outcome.arm is not None:
            attrs[sc.GATEWAY_AB_ARM] = outcome.arm
        if outcome.sla is not None:
            attrs[sc.GATEWAY_SLA_OUTCOME] = outcome.sla
        seen = self._seen
        reasons = list(seen.finish_reasons) if seen is not None else []
        if not reasons and self._names.latest and status in _ABNORMAL:
            reasons = [sc.FINISH_ERROR]  # a generation was expected but ended abnormally
        if reasons:
            attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] = reasons
        if seen is not None and seen.response_id is not None:
            attrs[sc.GEN_AI_RESPONSE_ID] = seen.response_id
        if state is not None:
            attrs.update(_server(state))
            attrs[sc.GEN_AI_RESPONSE_MODEL] = state.config.model
            price = state.config.usd_per_hour
            if price is not None:
                attrs[sc.GATEWAY_PRICE_USD_PER_HOUR] = price
            if outcome.usage is not None:
                cost = request_cost_usd(price, outcome.usage.completion_tokens, self._throughput(state.name))
                if cost is not None:
                    attrs[sc.GATEWAY_COST_USD] = cost
        leg, self._attempt = self._attempt, None
        if leg is not None:  # the attempt that opened the response: it ends with the response
            leg._span.set_attributes({k: v for k, v in attrs.items() if k.startswith("gen_ai.usage")
                                      or k in (sc.GEN_AI_RESPONSE_FINISH_REASONS, sc.GEN_AI_RESPONSE_ID)})
            if failed:
                leg._span.set_attribute(sc.ERROR_TYPE, status)
                leg._span.set_status(Status(StatusCode.ERROR, status))
            leg.end(None, status=int(status) if status.isdigit() else None)
        span = self._span
        span.set_attributes(attrs)
        if failed and not status.startswith("4") and status != "client_closed":  # 4xx: the client's doing
            span.set_status(Status(StatusCode.ERROR, status))
        span.end()
