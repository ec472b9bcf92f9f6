"""vLLM's Prometheus families (spec 2.9, names/types/labels as in the captured metrics.txt), kept in a
real `CollectorRegistry` per emulator so single-process semantics (`_total`, `_created`) come for free.

Update cadence as in vLLM: gauges every engine step, token counters per step, TTFT at first token,
ITL per token, request histograms at finish, prefix-cache counters at scheduling.

With data parallelism every engine has its own series, labelled `engine="<rank>"` (vLLM's
`PrometheusStatLogger` over its `engine_indexes`); `engine(r)` is rank r's step observer.
"""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from backends.emulator.engine import Finished, Snapshot, StepResult
from backends.emulator.profiles import CacheKind, EngineParams

_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0)
_ITER = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
LABELS = ("engine", "model_name")


def _token_buckets(max_model_len: int) -> tuple[float, ...]:
    return tuple(float(b) for b in _TOKENS if b <= max_model_len)


class VllmMetrics:
    def __init__(self, model: str, params: EngineParams, *, max_model_len: int, prefix_caching: bool,
                 engines: int = 1, external_source: str = "p2p") -> None:
        # the `prompt_tokens_cached_by_source` tier of KV loaded by the connector (NIXL: p2p)
        self._external_source = external_source
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._lvs = [{"engine": str(i), "model_name": model} for i in range(engines)]
        # A single-API-server vLLM also exposes the python_* and process_* families.
        for collector in (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR):
            r.register(collector)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*LABELS, *extra), registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r)

        tok = _token_buckets(max_model_len)
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
            "Sum of all reasons equals vllm:num_requests_waiting.", (*LABELS, "reason"), registry=r)
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            (*LABELS, "sleep_state"), registry=r)
        for state, v in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
            for each in self._lvs:
                sleep.labels(sleep_state=state, **each).set(v)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.pc_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.pc_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",))
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        self.cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to "
            "DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at "
            "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.", ("source",))
        self.ext_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
            "number of queried tokens.")
        self.ext_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number "
            "of cached tokens.")
        zero_counters = [
            counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
            counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
        ]
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.admission = Counter(
            "vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
            ("model_name", "reason"), registry=r)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok)
        self.req_gen = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tok)
        self.iter_tokens = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            tuple(float(b) for b in _ITER))
        self.max_gen = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tok)
        self.params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", (1.0, 2.0, 5.0, 10.0, 20.0))
        self.params_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tok)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", _ITL)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _E2E)
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _E2E)
        self.inference = hist(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", _E2E)
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", _E2E)
        self.decode = hist(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _E2E)
        self.req_preempt = hist(
            "vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.",
            (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0))
        self.kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tok)
        info_labels = {
            "block_size": str(params.block_size), "cache_dtype": "auto",
            "enable_prefix_caching": str(prefix_caching and params.cache_kind is not CacheKind.NONE),
            "engine": "0", "gpu_memory_utilization": "0.92", "num_cpu_blocks": "None",
            "num_gpu_blocks": str(params.kv_blocks), "prefix_caching_hash_algo": "sha256",
            "sliding_window": "None",
        }
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", sorted(info_labels),
                     registry=r)
        for each in self._lvs:
            info.labels(**{**info_labels, "engine": each["engine"]}).set(1.0)
        for each in self._lvs:
            self._precreate(each, zero_counters)
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            self.admission.labels(model_name=model, reason=reason)
        self._last_token: dict[str, float] = {}

    def _precreate(self, lv: dict[str, str], zero_counters: list[Counter]) -> None:
        """Every labelled child of one engine, so zero series exist from the start, as in vLLM."""
        for reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason, **lv)
        for reason in ("capacity", "deferred"):
            self.waiting_by_reason.labels(reason=reason, **lv)
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            self.prompt_by_source.labels(source=src, **lv)
        for src in ("device", "host", "p2p", "disk", "external_unspecified"):
            self.cached_by_source.labels(source=src, **lv)
        for zc in zero_counters:
            zc.labels(**lv)
        for m in (
            self.running, self.waiting, self.kv_usage, self.pc_queries, self.pc_hits, self.preemptions,
            self.prompt_tokens, self.prompt_cached, self.generation_tokens, self.ext_queries, self.ext_hits,
            self.req_prompt, self.req_gen,
            self.iter_tokens, self.max_gen, self.params_n, self.params_max_tokens, self.ttft, self.itl, self.tpot,
            self.e2e, self.queue, self.inference, self.prefill, self.decode, self.req_preempt, self.kv_computed,
        ):
            m.labels(**lv)

    def engine(self, rank: int) -> EngineMetrics:
        """The step observer of data-parallel rank `rank`'s engine (its `engine` label)."""
        return EngineMetrics(self, self._lvs[rank])

    def on_request(self, *, n: int, max_tokens: int, engine: int = 0) -> None:
        lv = self._lvs[engine]
        self.params_n.labels(**lv).observe(n)
        self.params_max_tokens.labels(**lv).observe(max_tokens)
        self.max_gen.labels(**lv).observe(max_tokens)

    def on_admission_rejected(self, model: str) -> None:
        self.admission.labels(model_name=model, reason="max_num_queued_reqs").inc()

    def on_step(self, step: StepResult, snap: Snapshot) -> None:
        self.step_of(self._lvs[0], step, snap)

    def on_finished(self, fin: Finished) -> None:
        self.finished_of(self._lvs[0], fin)

    def on_idle(self, snap: Snapshot) -> None:
        self.idle_of(self._lvs[0], snap)

    def step_of(self, lv: dict[str, str], step: StepResult, snap: Snapshot) -> None:
        self._waiting_gauges(lv, snap)
        self.kv_usage.labels(**lv).set(snap.kv_usage)
        for a in step.admitted:
            local = a.cached_tokens - a.external_tokens
            self.pc_queries.labels(**lv).inc(a.prompt_tokens)
            self.pc_hits.labels(**lv).inc(local)
            self.prompt_tokens.labels(**lv).inc(a.prompt_tokens)
            self.prompt_by_source.labels(source="local_compute", **lv).inc(a.prompt_tokens - a.cached_tokens)
            self.prompt_by_source.labels(source="local_cache_hit", **lv).inc(local)
            self.prompt_cached.labels(**lv).inc(a.cached_tokens)
            self.cached_by_source.labels(source="device", **lv).inc(local)
            if a.external_tokens:
                self.prompt_by_source.labels(source="external_kv_transfer", **lv).inc(a.external_tokens)
                self.cached_by_source.labels(source=self._external_source, **lv).inc(a.external_tokens)
                self.ext_queries.labels(**lv).inc(a.prompt_tokens - local)
                self.ext_hits.labels(**lv).inc(a.external_tokens)
        if step.preempted:
            self.preemptions.labels(**lv).inc(step.preempted)
        self.generation_tokens.labels(**lv).inc(len(step.tokens))
        self.iter_tokens.labels(**lv).observe(step.prefill_tokens + step.decode_tokens)
        for ev in step.tokens:
            last = self._last_token.get(ev.rid)
            if last is None:
                self.ttft.labels(**lv).observe(ev.time_s - ev.arrival_s)
            else:
                self.itl.labels(**lv).observe(ev.time_s - last)
            self._last_token[ev.rid] = ev.time_s

    def finished_of(self, lv: dict[str, str], fin: Finished) -> None:
        self._last_token.pop(fin.rid, None)
        self.success.labels(finished_reason=fin.reason, **lv).inc()
        self.req_prompt.labels(**lv).observe(fin.prompt_tokens)
        self.req_gen.labels(**lv).observe(fin.output_tokens)
        self.e2e.labels(**lv).observe(fin.e2e_s)
        self.queue.labels(**lv).observe(fin.queue_s)
        self.req_preempt.labels(**lv).observe(fin.preemptions)
        self.kv_computed.labels(**lv).observe(fin.prompt_tokens - fin.cached_tokens)
        if fin.scheduled_s is not None:
            self.inference.labels(**lv).observe(fin.finished_s - fin.scheduled_s)
            if fin.first_token_s is not None:
                self.prefill.labels(**lv).observe(fin.first_token_s - fin.scheduled_s)
                self.decode.labels(**lv).observe(fin.finished_s - fin.first_token_s)
                if fin.output_tokens > 1:
                    self.tpot.labels(**lv).observe((fin.finished_s - fin.first_token_s) / (fin.output_tokens - 1))

    def idle_of(self, lv: dict[str, str], snap: Snapshot) -> None:
        self._waiting_gauges(lv, snap)
        self.kv_usage.labels(**lv).set(snap.kv_usage)

    def _waiting_gauges(self, lv: dict[str, str], snap: Snapshot) -> None:
        """Running and waiting; a request waiting for its KV transfer is waiting, `deferred` (vLLM's
        WAITING_FOR_REMOTE_KVS), the rest wait for `capacity`."""
        self.running.labels(**lv).set(snap.running)
        self.waiting.labels(**lv).set(snap.waiting)
        self.waiting_by_reason.labels(reason="capacity", **lv).set(snap.waiting - snap.deferred)
        self.waiting_by_reason.labels(reason="deferred", **lv).set(snap.deferred)


class EngineMetrics:
    """One engine's (one data-parallel rank's) step observer over the shared families."""

    def __init__(self, metrics: VllmMetrics, lv: dict[str, str]) -> None:
        self._m = metrics
        self._lv = lv

    def on_step(self, step: StepResult, snap: Snapshot) -> None:
        self._m.step_of(self._lv, step, snap)

    def on_finished(self, fin: Finished) -> None:
        self._m.finished_of(self._lv, fin)

    def on_idle(self, snap: Snapshot) -> None:
        self._m.idle_of(self._lv, snap)
