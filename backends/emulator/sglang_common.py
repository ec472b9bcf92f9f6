"""What the SGLang face's modules share: version, error type, admission checks."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from backends.emulator.context import FaceContext
from backends.emulator.openai_common import flat_error
from backends.emulator.sglang_metrics import SglangMetrics
from backends.emulator.textgen import OutputPlan

VERSION = "0.5.23"
EOS_ID = 151645
METRICS_KEY = web.AppKey("sglang_metrics", SglangMetrics)
HEALTH_TIMEOUT_S = 20.0
# Estimated (SGLang's exact text not found): what an --is-embedding server says to a generation request.
NOT_GENERATION = "This model is an embedding model (--is-embedding) and does not support generation requests."


class Reject(Exception):
    def __init__(self, status: int, message: str, err_type: str) -> None:
        self.status, self.message, self.err_type = status, message, err_type

    def body(self) -> dict[str, Any]:
        return flat_error(self.status, self.message, self.err_type)


def matched(plan: OutputPlan) -> int | str | None:
    if plan.finish_reason != "stop":
        return None
    return plan.stop_reason if plan.stop_reason is not None else EOS_ID


def admit(ctx: FaceContext) -> None:
    if not ctx.gate.ready():
        ctx.stats.rejected_not_ready += 1
        raise Reject(503, "The server is not ready yet.", "Service Unavailable")
    status = ctx.gate.injected_failure()
    if status is not None:
        ctx.stats.failed_injected += 1
        raise Reject(status, "Injected failure", str(status))
    if ctx.gate.queue_full(ctx.snapshot().waiting):
        ctx.stats.rejected_queue_full += 1
        raise Reject(503, "The request queue is full.", "SERVICE_UNAVAILABLE")
