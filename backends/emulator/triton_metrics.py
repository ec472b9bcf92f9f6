"""Triton's metrics page (spec 4.2.3), written by hand the way prometheus-cpp writes text 0.0.4:
alphabetical labels, integers without a decimal point, no `_created`, no OpenMetrics. Served on the
separate metrics port (Triton's :8002). Durations are simulated microseconds."""

from __future__ import annotations

from collections.abc import Iterable

from backends.emulator.engine import Finished, Snapshot, StepResult
from backends.emulator.profiles import EngineParams

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MODELS = ("ensemble", "tensorrt_llm")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _labels(pairs: dict[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items()))


class TritonMetrics:
    def __init__(self, params: EngineParams) -> None:
        self.params = params
        self.success = 0
        self.failure = 0
        self.exec_count = 0
        self.request_duration_us = 0.0
        self.queue_duration_us = 0.0
        self.reused_blocks = 0
        self.iteration = 0
        self.last_step: StepResult | None = None
        self.snap: Snapshot | None = None

    def on_failure(self) -> None:
        self.failure += 1

    def on_step(self, step: StepResult, snap: Snapshot) -> None:
        self.iteration += 1
        self.exec_count += 1
        self.last_step, self.snap = step, snap
        self.reused_blocks += sum(a.cached_tokens // self.params.block_size for a in step.admitted)

    def on_finished(self, fin: Finished) -> None:
        if fin.reason == "abort":
            self.failure += 1
            return
        self.success += 1
        self.request_duration_us += fin.e2e_s * 1e6
        self.queue_duration_us += fin.queue_s * 1e6

    def on_idle(self, snap: Snapshot) -> None:
        self.snap = snap
        self.last_step = None

    def render(self, snap: Snapshot, *, now_us: int) -> bytes:
        out: list[str] = []

        def family(name: str, kind: str, doc: str, rows: Iterable[tuple[dict[str, str], float]]) -> None:
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{{{_labels(lbl)}}} {_num(v)}" for lbl, v in rows)

        def per_model(v: float) -> list[tuple[dict[str, str], float]]:
            return [({"model": m, "version": "1"}, v) for m in MODELS]

        family("nv_inference_request_success", "counter",
               "Number of successful inference requests, all batch sizes", per_model(self.success))
        family("nv_inference_request_failure", "counter",
               "Number of failed inference requests, all batch sizes", per_model(self.failure))
        family("nv_inference_count", "counter", "Number of inferences performed (does not include cached requests)",
               per_model(self.success))
        family("nv_inference_exec_count", "counter",
               "Number of model executions performed (does not include cached requests)", per_model(self.exec_count))
        family("nv_inference_request_duration_us", "counter",
               "Cumulative inference request duration in microseconds (includes cached requests)",
               per_model(round(self.request_duration_us)))
        family("nv_inference_queue_duration_us", "counter",
               "Cumulative inference queuing duration in microseconds (includes cached requests)",
               per_model(round(self.queue_duration_us)))
        family("nv_inference_pending_request_count", "gauge",
               "Instantaneous number of pending requests awaiting execution per-model.", per_model(snap.waiting))
        step = self.last_step
        trt = {"model": "tensorrt_llm", "version": "1"}
        family("nv_trt_llm_request_metrics", "gauge", "TRT LLM request metrics", [
            ({**trt, "request_type": "waiting"}, snap.waiting),
            ({**trt, "request_type": "context"}, len(step.admitted) if step else 0),
            ({**trt, "request_type": "scheduled"}, snap.running),
            ({**trt, "request_type": "max"}, self.params.max_num_seqs),
            ({**trt, "request_type": "active"}, snap.running),
        ])
        family("nv_trt_llm_kv_cache_block_metrics", "gauge", "TRT LLM KV cache block metrics", [
            ({**trt, "kv_cache_block_type": "fraction"}, snap.kv_usage),
            ({**trt, "kv_cache_block_type": "tokens_per"}, snap.block_size),
            ({**trt, "kv_cache_block_type": "used"}, snap.kv_used_blocks),
            ({**trt, "kv_cache_block_type": "free"}, snap.kv_total_blocks - snap.kv_used_blocks),
            ({**trt, "kv_cache_block_type": "max"}, snap.kv_total_blocks),
            ({**trt, "kv_cache_block_type": "reused"}, self.reused_blocks),
        ])
        family("nv_trt_llm_inflight_batcher_metrics", "gauge", "TRT LLM inflight_batcher-specific metrics", [
            ({**trt, "inflight_batcher_specific_metric": "total_context_tokens"}, step.prefill_tokens if step else 0),
            ({**trt, "inflight_batcher_specific_metric": "generation_requests"}, step.decode_tokens if step else 0),
            ({**trt, "inflight_batcher_specific_metric": "micro_batch_id"}, 0),
            ({**trt, "inflight_batcher_specific_metric": "paused_requests"}, 0),
        ])
        family("nv_trt_llm_general_metrics", "gauge", "General TRT LLM metrics", [
            ({**trt, "general_type": "timestamp"}, now_us),
            ({**trt, "general_type": "iteration_counter"}, self.iteration),
        ])
        return ("\n".join(out) + "\n").encode()
