"""trtllm-serve's two metric surfaces (spec 4.1.3 and 4.1.4).

* `GET /metrics`: a JSON array of per-iteration stats, drained destructively (each iteration is
  returned once; `[]` when nothing is new), capped at `iter_stats_max_iterations` = 1000.
* `GET /prometheus/metrics`: `trtllm_` families in multiprocess style (sorted labels, no `_created`),
  with labels `{engine_type="undefined", model_name="undefined"}`. Iteration gauges refresh only when
  a request finishes, so they are stale while long requests run, as in trtllm-serve.
"""

from __future__ import annotations

import datetime
import math
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from backends.emulator.engine import Finished, Snapshot, StepResult
from backends.emulator.exposition import Hist, hist_family
from backends.emulator.profiles import EngineParams

MAX_ITERATIONS = 1000
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0)
LABELS = {"engine_type": "undefined", "model_name": "undefined"}


class TrtllmMetrics:
    def __init__(self, params: EngineParams) -> None:
        self.params = params
        self.iterations: deque[dict[str, Any]] = deque(maxlen=MAX_ITERATIONS)
        self._iter = 0
        self.reused_blocks = 0
        self.missed_blocks = 0
        self.alloc_new = 0
        self.completed_total = 0
        self.success = dict.fromkeys(("stop", "length", "abort"), 0.0)
        self.prompt_tokens = 0.0
        self.cached_tokens = 0.0
        self.generation_tokens = 0.0
        self.ttft, self.tpot = Hist(_TTFT), Hist(_TPOT)
        self.e2e, self.queue = Hist(_E2E), Hist(_E2E)
        self.gauges = {"running": 0.0, "waiting": 0.0, "kv_util": 0.0, "hit_rate": 0.0, "used": 0.0}
        self._completed_in_iter = 0
        self._last_snap: Snapshot | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def drain(self) -> list[dict[str, Any]]:
        out = list(self.iterations)
        self.iterations.clear()
        return out

    def on_step(self, step: StepResult, snap: Snapshot) -> None:
        bs = self.params.block_size
        for a in step.admitted:
            reused = a.cached_tokens // bs
            missed = math.ceil((a.prompt_tokens - a.cached_tokens) / bs)
            self.reused_blocks += reused
            self.missed_blocks += missed
            self.alloc_new += missed
            self.prompt_tokens += a.prompt_tokens
            self.cached_tokens += a.cached_tokens
        self.generation_tokens += len(step.tokens)
        for ev in step.tokens:
            if ev.index == 0:
                self.ttft.observe(ev.time_s - ev.arrival_s)
        finished = sum(1 for ev in step.tokens if ev.finished is not None)
        self._iter += 1
        self._last_snap = snap
        lookups = self.reused_blocks + self.missed_blocks
        ts = datetime.datetime.now(datetime.UTC).strftime("%m-%d-%Y %H:%M:%S.%f")
        self.iterations.append({
            "timestamp": ts, "iter": self._iter, "iterLatencyMS": step.duration_s * 1000.0,
            "newActiveRequestsQueueLatencyMS": 0.0, "numNewActiveRequests": len(step.admitted),
            "numActiveRequests": snap.running, "numQueuedRequests": snap.waiting, "numCompletedRequests": finished,
            "maxNumActiveRequests": self.params.max_num_seqs, "maxBatchSizeStatic": 0,
            "maxBatchSizeTunerRecommended": 0, "maxBatchSizeRuntime": 0, "maxNumTokensStatic": 0,
            "maxNumTokensTunerRecommended": 0, "maxNumTokensRuntime": 0, "gpuMemUsage": 0, "cpuMemUsage": 0,
            "pinnedMemUsage": 0,
            "kvCacheStats": {
                "maxNumBlocks": snap.kv_total_blocks, "freeNumBlocks": snap.kv_total_blocks - snap.kv_used_blocks,
                "usedNumBlocks": snap.kv_used_blocks, "tokensPerBlock": bs,
                "allocTotalBlocks": self.alloc_new + self.reused_blocks, "allocNewBlocks": self.alloc_new,
                "reusedBlocks": self.reused_blocks, "missedBlocks": self.missed_blocks,
                "cacheHitRate": self.reused_blocks / lookups if lookups else 0.0,
            },
            "staticBatchingStats": {"numScheduledRequests": 0, "numContextRequests": 0, "numCtxTokens": 0,
                                    "numGenTokens": 0, "emptyGenSlots": 0},
            "inflightBatchingStats": {
                "numScheduledRequests": snap.running, "numContextRequests": len(step.admitted),
                "numGenRequests": step.decode_tokens, "numPausedRequests": 0, "numCtxTokens": step.prefill_tokens,
                "microBatchId": 0, "avgNumDecodedTokensPerIter": 1.0, "numCtxKvTokens": 0, "numGenKvTokens": 0,
                "numQueuedContextRequests": 0, "numQueuedCtxTokens": 0, "numQueuedGenRequests": 0,
                "numQueuedGenKvTokens": 0, "numPausedKvTokens": 0,
            },
            "specDecodingStats": None, "schedulerMode": "overlap", "statsSequence": self._iter,
            "statsDroppedFrames": 0, "attentionDpRank": 0,
        })

    def on_finished(self, fin: Finished) -> None:
        self.completed_total += 1
        self.success[fin.reason] = self.success.get(fin.reason, 0.0) + 1
        self.e2e.observe(fin.e2e_s)
        self.queue.observe(fin.queue_s)
        if fin.first_token_s is not None and fin.output_tokens > 1:
            self.tpot.observe((fin.finished_s - fin.first_token_s) / (fin.output_tokens - 1))
        snap = self._last_snap
        if snap is not None:  # the iteration gauges refresh only on a request finishing
            lookups = self.reused_blocks + self.missed_blocks
            self.gauges.update(
                running=float(snap.running), waiting=float(snap.waiting), kv_util=snap.kv_usage,
                used=float(snap.kv_used_blocks), hit_rate=self.reused_blocks / lookups if lookups else 0.0)

    def on_idle(self, snap: Snapshot) -> None:
        self._last_snap = snap

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        names, values = list(LABELS), list(LABELS.values())

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, v)
            return c

        c = CounterMetricFamily("trtllm_request_success", "Count of successfully processed requests.",
                                labels=["engine_type", "finished_reason", "model_name"])
        for reason, v in self.success.items():
            c.add_metric([LABELS["engine_type"], reason, LABELS["model_name"]], v)
        yield c
        yield hist_family("trtllm_e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                          LABELS, [({}, self.e2e)])
        yield hist_family("trtllm_time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                          LABELS, [({}, self.ttft)])
        yield hist_family("trtllm_time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                          LABELS, [({}, self.tpot)])
        yield hist_family("trtllm_request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", LABELS, [({}, self.queue)])
        yield counter("trtllm_prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens)
        yield counter("trtllm_generation_tokens", "Number of generation tokens processed.", self.generation_tokens)
        yield counter("trtllm_prompt_cached_tokens", "Number of cached prompt tokens.", self.cached_tokens)
        g = self.gauges
        yield gauge("trtllm_kv_cache_hit_rate", "KV cache hit rate.", g["hit_rate"])
        yield gauge("trtllm_kv_cache_utilization", "KV cache utilization.", g["kv_util"])
        yield counter("trtllm_kv_cache_reused_blocks", "Number of reused KV cache blocks.", float(self.reused_blocks))
        yield counter("trtllm_kv_cache_missed_blocks", "Number of missed KV cache blocks.", float(self.missed_blocks))
        yield gauge("trtllm_num_requests_running", "Number of requests running.", g["running"])
        yield gauge("trtllm_num_requests_waiting", "Number of requests waiting.", g["waiting"])
        yield counter("trtllm_num_requests_completed", "Number of completed requests.", float(self.completed_total))
        yield gauge("trtllm_max_num_active_requests", "Maximum number of active requests.",
                    float(self.params.max_num_seqs))
        yield gauge("trtllm_kv_cache_max_blocks", "Maximum number of KV cache blocks.", float(self.params.kv_blocks))
        yield gauge("trtllm_kv_cache_used_blocks", "Used KV cache blocks.", g["used"])
        yield gauge("trtllm_kv_cache_free_blocks", "Free KV cache blocks.", float(self.params.kv_blocks) - g["used"])
        yield gauge("trtllm_kv_cache_tokens_per_block", "Tokens per KV cache block.", float(self.params.block_size))
