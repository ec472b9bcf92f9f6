"""SGLang's Prometheus families (spec 3.7) as a custom collector, rendered the way SGLang's
multiprocess registry renders them: label names sorted, no `_created` series.

Scheduler gauges are published with SGLang's cadence: on every prefill batch, every 40 decode steps,
and when the engine goes idle (which zeroes `gen_throughput`); between publications they are stale.
With data parallelism each DP rank's scheduler publishes its own gauges, with a `dp_rank` label
(SGLang adds it to the scheduler's labels when `dp_rank` is set); `rank(r)` is rank r's observer.
The tokenizer-side counters and histograms are the one front end's, without it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from backends.emulator.engine import Finished, Snapshot, StepResult
from backends.emulator.exposition import Hist, hist_family
from backends.emulator.profiles import EngineParams

DECODE_LOG_INTERVAL = 40
_TTFT = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_ITL = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 0.6,
        0.8, 1, 2, 4, 6, 8)
_E2E = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
_STREAMING = ("false", "true")


class _Scheduler:
    """One DP rank's scheduler gauges and the window its throughput is computed over."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.published = {"num_running_reqs": 0.0, "num_queue_reqs": 0.0, "token_usage": 0.0,
                          "cache_hit_rate": 0.0, "gen_throughput": 0.0, "num_used_tokens": 0.0,
                          "num_pd_queue_reqs": 0.0}
        self.decode_steps = 0
        self.window_tokens = 0
        self.window_start: float | None = None


class SglangMetrics:
    def __init__(self, model: str, params: EngineParams, *, context_len: int, dp_size: int = 1,
                 disaggregation_mode: str = "null") -> None:
        self.params = params
        self.context_len = context_len
        # P/D: `engine_type` is the server's mode, and the requests outside the waiting queue (a
        # prefill's bootstrap queue, a decode's transfer queue: `Snapshot.deferred`) have their gauge
        self.mode = disaggregation_mode
        engine_type = "unified" if disaggregation_mode == "null" else disaggregation_mode
        self.sched = {"engine_type": engine_type, "model_name": model, "moe_ep_rank": "0", "pp_rank": "0",
                      "tp_rank": "0"}
        self.tok = {"engine_type": engine_type, "model_name": model}
        self.schedulers = [_Scheduler(self.sched if dp_size == 1 else {**self.sched, "dp_rank": str(r)})
                           for r in range(dp_size)]
        self.published = self.schedulers[0].published  # rank 0's (the only one without DP)
        self.prompt_tokens = dict.fromkeys(_STREAMING, 0.0)
        self.generation_tokens = dict.fromkeys(_STREAMING, 0.0)
        self.num_requests = dict.fromkeys(_STREAMING, 0.0)
        self.cached_tokens = 0.0
        self.aborted = 0.0
        self.ttft = {s: Hist(_TTFT) for s in _STREAMING}
        self.e2e = {s: Hist(_E2E) for s in _STREAMING}
        self.itl = Hist(_ITL)
        self.queue = Hist(_E2E)
        self.streaming: dict[str, str] = {}
        self._last: dict[str, float] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def register(self, rids: list[str], *, streaming: bool) -> None:
        flag = "true" if streaming else "false"
        for rid in rids:
            self.streaming[rid] = flag
        self.num_requests[flag] += 1

    def rank(self, dp_rank: int) -> RankMetrics:
        """The step observer of data-parallel rank `dp_rank`'s scheduler."""
        return RankMetrics(self, self.schedulers[dp_rank])

    def _publish(self, sched: _Scheduler, snap: Snapshot, now: float, hit_rate: float | None) -> None:
        p = sched.published
        p["num_running_reqs"] = float(snap.running)
        p["num_queue_reqs"] = float(snap.waiting - snap.deferred)
        p["num_pd_queue_reqs"] = float(snap.deferred)
        p["token_usage"] = snap.kv_usage
        p["num_used_tokens"] = float(snap.kv_used_blocks * snap.block_size)
        if hit_rate is not None:
            p["cache_hit_rate"] = hit_rate
        if sched.window_start is not None and now > sched.window_start:
            p["gen_throughput"] = sched.window_tokens / (now - sched.window_start)
        sched.window_start, sched.window_tokens = now, 0

    def on_step(self, step: StepResult, snap: Snapshot) -> None:
        self.step_of(self.schedulers[0], step, snap)

    def on_finished(self, fin: Finished) -> None:
        self.finished_of(fin)

    def on_idle(self, snap: Snapshot) -> None:
        self.idle_of(self.schedulers[0], snap)

    def step_of(self, sched: _Scheduler, step: StepResult, snap: Snapshot) -> None:
        if sched.window_start is None:
            sched.window_start = step.start_s
        sched.window_tokens += len(step.tokens)
        for ev in step.tokens:
            flag = self.streaming.get(ev.rid, "false")
            last = self._last.get(ev.rid)
            if last is None:
                self.ttft[flag].observe(ev.time_s - ev.arrival_s)
            else:
                self.itl.observe(ev.time_s - last)
            self._last[ev.rid] = ev.time_s
            self.generation_tokens[flag] += 1
        hits = sum(a.cached_tokens for a in step.admitted)
        total = sum(a.prompt_tokens for a in step.admitted)
        for a in step.admitted:
            self.prompt_tokens[self.streaming.get(a.rid, "false")] += a.prompt_tokens
        self.cached_tokens += hits
        if step.prefill_tokens:
            self._publish(sched, snap, step.end_s, hits / total if total else None)
        else:
            sched.decode_steps += 1
            if sched.decode_steps % DECODE_LOG_INTERVAL == 0:
                self._publish(sched, snap, step.end_s, None)

    def finished_of(self, fin: Finished) -> None:
        flag = self.streaming.pop(fin.rid, "false")
        self._last.pop(fin.rid, None)
        if fin.reason == "abort":
            self.aborted += 1
        self.e2e[flag].observe(fin.e2e_s)
        self.queue.observe(fin.queue_s)

    def idle_of(self, sched: _Scheduler, snap: Snapshot) -> None:
        p = sched.published
        p["num_running_reqs"] = float(snap.running)
        p["num_queue_reqs"] = float(snap.waiting - snap.deferred)
        p["num_pd_queue_reqs"] = float(snap.deferred)
        p["token_usage"] = snap.kv_usage
        p["num_used_tokens"] = float(snap.kv_used_blocks * snap.block_size)
        p["gen_throughput"] = 0.0
        sched.window_start = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        t = self.tok
        scheds = self.schedulers

        def gauge(name: str, doc: str, key: str | None, value: float = 0.0) -> GaugeMetricFamily:
            names = sorted(scheds[0].labels)
            g = GaugeMetricFamily(name, doc, labels=names)
            for sched in scheds:
                g.add_metric([sched.labels[k] for k in names], sched.published[key] if key else value)
            return g

        yield gauge("sglang:num_running_reqs", "The number of running requests.", "num_running_reqs")
        yield gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", "num_queue_reqs")
        if self.mode == "prefill":
            yield gauge("sglang:num_prefill_prealloc_queue_reqs", "The number of requests in the prefill prealloc "
                        "queue.", "num_pd_queue_reqs")
        elif self.mode == "decode":
            yield gauge("sglang:num_decode_transfer_queue_reqs", "The number of requests in the decode transfer "
                        "queue.", "num_pd_queue_reqs")
        yield gauge("sglang:token_usage", "The token usage.", "token_usage")
        yield gauge("sglang:num_used_tokens", "The number of used tokens.", "num_used_tokens")
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", "cache_hit_rate")
        yield gauge("sglang:gen_throughput", "The generation throughput (token/s).", "gen_throughput")
        yield gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", None,
                    float(self.params.kv_blocks * self.params.block_size))
        yield gauge("sglang:page_size", "The page size of the KV cache.", None, float(self.params.block_size))
        yield gauge("sglang:context_len", "The context length of the model.", None, float(self.context_len))
        for name, doc, values in (
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            ("sglang:generation_tokens", "Number of generation tokens processed.", self.generation_tokens),
            ("sglang:num_requests", "The number of processed requests.", self.num_requests),
        ):
            c = CounterMetricFamily(name, doc, labels=["engine_type", "is_streaming", "model_name"])
            for flag, v in values.items():
                c.add_metric([t["engine_type"], flag, t["model_name"]], v)
            yield c
        c = CounterMetricFamily("sglang:cached_tokens", "Number of cached prompt tokens.",
                                labels=["cache_source", "engine_type", "model_name"])
        for src in ("device", "host", "storage"):
            c.add_metric([src, t["engine_type"], t["model_name"]], self.cached_tokens if src == "device" else 0.0)
        yield c
        c = CounterMetricFamily("sglang:num_aborted_requests", "Number of requests aborted.", labels=sorted(t))
        c.add_metric([t[k] for k in sorted(t)], self.aborted)
        yield c
        yield hist_family("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", t,
                          (({"is_streaming": f}, h) for f, h in self.ttft.items()))
        yield hist_family("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", t,
                          [({}, self.itl)])
        yield hist_family("sglang:e2e_request_latency_seconds", "Histogram of E2E request latency in seconds", t,
                          (({"is_streaming": f}, h) for f, h in self.e2e.items()))
        yield hist_family("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", t,
                          [({}, self.queue)])


class RankMetrics:
    """One DP rank's scheduler observer over the shared collector."""

    def __init__(self, metrics: SglangMetrics, sched: _Scheduler) -> None:
        self._m = metrics
        self._sched = sched

    def on_step(self, step: StepResult, snap: Snapshot) -> None:
        self._m.step_of(self._sched, step, snap)

    def on_finished(self, fin: Finished) -> None:
        self._m.finished_of(fin)

    def on_idle(self, snap: Snapshot) -> None:
        self._m.idle_of(self._sched, snap)
