"""Prometheus metrics on an explicit registry: bounded labels, base units.

Labels are config names only (backend, runtime, model = the route's model). Unroutable requests use
backend="none", runtime="none", model="none" so that a client cannot mint label values.
Backend gauges (up, in flight, engine load) are read from the pool at scrape time by a collector, so
the request path never touches them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from backends.base import Usage

from ..merge_rules import Merge, declare
from ..state.pool import Pool
from .lockfree import CounterChild, FastCounter, FastHistogram, HistogramChild
from .outcome import ITL_BUCKETS, NONE, Outcome

TTFT_BUCKETS: Final = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
# OpenTelemetry GenAI semantic conventions: the explicit bucket boundaries they recommend.
GENAI_TTFT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
GENAI_TPOT_BUCKETS: Final = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GENAI_DURATION_BUCKETS: Final = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
GENAI_TOKEN_BUCKETS: Final = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
DURATION_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 60, 120, 240, 480, 960)
# |expected - reported| cached tokens: 0 is an exact prediction; engine blocks are 1-128 tokens
PREDICTION_ERROR_BUCKETS: Final = (0, 1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
# endpoints that are neither generation nor pooling: counted, but kept out of latency and tokens
AUXILIARY: Final = frozenset({"tokenize", "detokenize"})


@dataclass(slots=True)
class _Series:
    """Every labelled child one (backend, runtime, model) needs, looked up once and kept."""

    prompt: CounterChild
    completion: CounterChild
    cached: CounterChild
    ttft: HistogramChild
    itl: HistogramChild
    duration: HistogramChild
    genai_ttft: HistogramChild
    genai_tpot: HistogramChild
    genai_input: HistogramChild
    genai_output: HistogramChild
    statuses: dict[str, CounterChild]
    genai_durations: dict[str, HistogramChild]
    endpoints: dict[tuple[str, str], CounterChild]


class Recorder:
    """Counts every Outcome into Prometheus and hands it on to `observers` (the live comparison).

    Labelled children are resolved once per (backend, runtime, model) and cached, and histograms are
    lock-free (`promfast`), because this runs once per request and its gap loop once per token.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        pool: Pool,
        *,
        clock: Callable[[], float] | None = None,
        observers: Iterable[Callable[[Outcome], None]] = (),
    ) -> None:
        self._clock = clock
        self.observers = tuple(observers)
        base = ("backend", "runtime", "model")
        # Every family here counts what this process served: under `--workers N` they add up.
        def histogram(name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]) -> FastHistogram:
            h = FastHistogram(name, doc, labels, buckets)
            declare(Merge.SUM, name)
            registry.register(h)
            return h

        def counter(name: str, doc: str, labels: Sequence[str]) -> FastCounter:
            c = FastCounter(name, doc, labels)
            declare(Merge.SUM, name)
            registry.register(c)
            return c

        self.requests = counter("gateway_requests", "Requests by outcome.", (*base, "status"))
        self.endpoint_requests = counter(
            "gateway_endpoint_requests", "Requests by route, endpoint and outcome.", ("model", "endpoint", "status"))
        self.ab_excluded_requests = counter(
            "gateway_ab_excluded_requests",
            "Requests of split routes that are not A/B samples (only some arms can serve them, or no generation).",
            ("model", "reason"))
        self.tokens = counter("gateway_tokens", "Tokens by kind.", (*base, "kind"))

        self.ttft = histogram(
            "gateway_time_to_first_token_seconds",
            "Time from request arrival to the first streamed event, at the gateway.", base, TTFT_BUCKETS,
        )
        self.itl = histogram(
            "gateway_inter_token_latency_seconds", "Gap between consecutive streamed events, at the gateway.",
            base, ITL_BUCKETS,
        )
        self.duration = histogram(
            "gateway_request_duration_seconds", "Time from request arrival to the last byte sent.", base,
            DURATION_BUCKETS,
        )
        self.retries = counter(
            "gateway_retries", "Attempts retried on another backend.", ("backend", "runtime", "reason"))
        self.ejections = counter(
            "gateway_backend_ejections", "Outlier ejections (consecutive failures or failure rate).",
            ("backend", "runtime"))
        self.ejections_spared = counter(
            "gateway_backend_ejections_spared",
            "Ejections the rules called for but a route's or arm's guard refused (last backend, max_ejected_share).",
            ("backend", "runtime"))
        self.decisions = counter(
            "gateway_routing_decisions", "Routing decisions by route, policy and reason.",
            ("model", "policy", "reason"))
        self.sla = counter(
            "gateway_sla_requests", "Requests that carried an SLA target, by outcome (met|missed).",
            ("backend", "runtime", "outcome"))
        self.arm_requests = counter(
            "gateway_arm_requests", "Requests assigned to each A/B arm.", ("model", "arm"))
        self.arm_failovers = counter(
            "gateway_arm_failovers", "Requests moved off their arm because it had no healthy backend.",
            ("model", "arm"))
        self.shadow_requests = counter(
            "gateway_shadow_requests", "Mirrored (shadow) requests by arm and status.", ("model", "arm", "status"))
        self.shadow_tokens = counter(
            "gateway_shadow_tokens", "Tokens of mirrored requests.", ("model", "arm", "kind"))
        # The same measurements under the OpenTelemetry GenAI names (dots -> underscores), so stock
        # GenAI dashboards work: gen_ai_system = the runtime, gen_ai_request_model = the route's model.
        genai = ("gen_ai_system", "gen_ai_request_model", "backend")
        self.genai_ttft = histogram(
            "gen_ai_server_time_to_first_token_seconds", "GenAI semconv: time to first token (at the gateway).",
            genai, GENAI_TTFT_BUCKETS,
        )
        self.genai_tpot = histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "GenAI semconv: (duration - TTFT) / (output tokens - 1), per streamed request.", genai,
            GENAI_TPOT_BUCKETS,
        )
        self.genai_duration = histogram(
            "gen_ai_server_request_duration_seconds", "GenAI semconv: request duration at the gateway.",
            (*genai, "error_type"), GENAI_DURATION_BUCKETS,
        )
        self.genai_tokens = histogram(
            "gen_ai_client_token_usage", "GenAI semconv: tokens per request by gen_ai_token_type (input/output).",
            (*genai, "gen_ai_token_type"), GENAI_TOKEN_BUCKETS,
        )
        self.prediction_error = histogram(
            "gateway_prefix_prediction_error_tokens",
            "|cached tokens routing expected - cached tokens the engine reported| per response, by the prefix "
            "index that predicted (source = exact: the engine's KV events; approximate: what the gateway sent).",
            ("backend", "runtime", "source"), PREDICTION_ERROR_BUCKETS,
        )
        registry.register(_PoolCollector(pool))
        self._series: dict[tuple[str, str, str], _Series] = {}
        self._prediction: dict[tuple[str, str, str], HistogramChild] = {}

    def _series_for(self, key: tuple[str, str, str]) -> _Series:
        series = self._series.get(key)
        if series is None:
            backend, runtime, model = key
            genai = (runtime, model, backend)
            series = self._series[key] = _Series(
                prompt=self.tokens.labels(*key, "prompt"),
                completion=self.tokens.labels(*key, "completion"),
                cached=self.tokens.labels(*key, "cached"),
                ttft=self.ttft.labels(*key),
                itl=self.itl.labels(*key),
                duration=self.duration.labels(*key),
                genai_ttft=self.genai_ttft.labels(*genai),
                genai_tpot=self.genai_tpot.labels(*genai),
                genai_input=self.genai_tokens.labels(*genai, "input"),
                genai_output=self.genai_tokens.labels(*genai, "output"),
                statuses={},
                genai_durations={},
                endpoints={},
            )
        return series

    def record(self, o: Outcome) -> None:
        if o.finished_at == 0.0 and self._clock is not None:
            o = replace(o, finished_at=self._clock())
        key = (o.backend, o.runtime, o.model)
        s = self._series_for(key)
        status = s.statuses.get(o.status)
        if status is None:
            status = s.statuses[o.status] = self.requests.labels(*key, o.status)
        status.inc()
        by_endpoint = s.endpoints.get((o.endpoint, o.status))
        if by_endpoint is None:
            by_endpoint = s.endpoints[(o.endpoint, o.status)] = self.endpoint_requests.labels(
                o.model, o.endpoint, o.status)
        by_endpoint.inc()
        if o.endpoint in AUXILIARY:
            for observe in self.observers:
                observe(o)
            return
        exemplar = o.trace_id if o.sampled else None  # a sampled request's trace, linked from its buckets
        at = o.finished_at  # the gateway's clock reads as Unix time (`cluster.clock`)
        if exemplar is None:
            s.duration.observe(o.duration_s)
        else:
            s.duration.observe_exemplar(o.duration_s, exemplar, at)
        error_type = "" if o.status[0] == "2" else o.status
        genai_duration = s.genai_durations.get(error_type)
        if genai_duration is None:
            genai_duration = s.genai_durations[error_type] = self.genai_duration.labels(
                o.runtime, o.model, o.backend, error_type
            )
        if exemplar is None:
            genai_duration.observe(o.duration_s)
        else:
            genai_duration.observe_exemplar(o.duration_s, exemplar, at)
        usage = o.usage
        if usage is not None:
            s.prompt.inc(usage.prompt_tokens)
            s.completion.inc(usage.completion_tokens)
            if usage.cached_tokens:
                s.cached.inc(usage.cached_tokens)
            s.genai_input.observe(usage.prompt_tokens)
            s.genai_output.observe(usage.completion_tokens)
        if o.ttft_s is not None:
            if exemplar is None:
                s.ttft.observe(o.ttft_s)
                s.genai_ttft.observe(o.ttft_s)
            else:
                s.ttft.observe_exemplar(o.ttft_s, exemplar, at)
                s.genai_ttft.observe_exemplar(o.ttft_s, exemplar, at)
            if usage is not None and usage.completion_tokens > 1:
                s.genai_tpot.observe(max(o.duration_s - o.ttft_s, 0.0) / (usage.completion_tokens - 1))
        if o.gaps is not None and o.gaps.count:
            s.itl.observe_counted(((c.value, c.count) for c in o.gaps.hist.cells.values()), o.gaps.sum)
        if o.sla is not None:
            self.sla.labels(o.backend, o.runtime, o.sla).inc()
        expected = o.expected_cached_tokens
        if expected is not None and usage is not None and usage.cached_tokens is not None and not o.usage_estimated:
            pkey = (o.backend, o.runtime, o.prediction or NONE)
            child = self._prediction.get(pkey)
            if child is None:
                child = self._prediction[pkey] = self.prediction_error.labels(*pkey)
            child.observe(abs(expected - usage.cached_tokens))
        for observe in self.observers:
            observe(o)

    def retry(self, backend: str, runtime: str, reason: str) -> None:
        self.retries.labels(backend, runtime, reason).inc()

    def ejected(self, backend: str, runtime: str) -> None:
        self.ejections.labels(backend, runtime).inc()

    def ejection_spared(self, backend: str, runtime: str) -> None:
        self.ejections_spared.labels(backend, runtime).inc()

    def decision(self, model: str, policy: str, reason: str) -> None:
        self.decisions.labels(model, policy, reason).inc()

    def ab_excluded(self, model: str, reason: str) -> None:
        self.ab_excluded_requests.labels(model, reason).inc()

    def arm_assigned(self, model: str, arm: str, *, failed_over_from: str | None) -> None:
        self.arm_requests.labels(model, arm).inc()
        if failed_over_from is not None:
            self.arm_failovers.labels(model, failed_over_from).inc()

    def shadow(self, model: str, arm: str, status: str, usage: Usage | None) -> None:
        self.shadow_requests.labels(model, arm, status).inc()
        if usage is not None:
            self.shadow_tokens.labels(model, arm, "prompt").inc(usage.prompt_tokens)
            self.shadow_tokens.labels(model, arm, "completion").inc(usage.completion_tokens)


# Under `--workers N`: a backend is up where every worker routes to it (each ejects outliers on its
# own); in-flight requests are each worker's own; the engine's load comes from the supervisor's one
# probe, the same for every worker.
declare(Merge.MIN, "gateway_backend_up")
declare(Merge.SUM, "gateway_backend_in_flight")
declare(Merge.MAX, "gateway_backend_engine_running", "gateway_backend_engine_waiting",
        "gateway_backend_engine_kv_cache_usage_ratio", "gateway_backend_engine_prefix_cache_hit_ratio")


class _PoolCollector:
    """Backend gauges read from the pool when Prometheus scrapes."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["backend", "runtime"]
        fams = {
            "up": GaugeMetricFamily("gateway_backend_up", "1 when the backend is routable.", labels=labels),
            "in_flight": GaugeMetricFamily(
                "gateway_backend_in_flight", "Requests the gateway has open to the backend.", labels=labels
            ),
            "running": GaugeMetricFamily(
                "gateway_backend_engine_running", "Engine-reported running requests.", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                "gateway_backend_engine_waiting", "Engine-reported waiting requests.", labels=labels
            ),
            "kv_usage": GaugeMetricFamily(
                "gateway_backend_engine_kv_cache_usage_ratio", "Engine-reported KV-cache usage (0-1).",
                labels=labels,
            ),
            "prefix_hit_rate": GaugeMetricFamily(
                "gateway_backend_engine_prefix_cache_hit_ratio", "Engine-reported prefix-cache hit rate (0-1).",
                labels=labels,
            ),
        }
        for s in self._pool:
            lv = [s.name, s.config.runtime.value]
            fams["up"].add_metric(lv, 1.0 if s.healthy else 0.0)
            fams["in_flight"].add_metric(lv, float(s.in_flight))
            for key in ("running", "waiting", "kv_usage", "prefix_hit_rate"):
                value = getattr(s.load, key)
                if value is not None:
                    fams[key].add_metric(lv, float(value))
        yield from fams.values()
