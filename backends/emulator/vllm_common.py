"""What the vLLM face's modules share: the metrics key, rejections and admission checks."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from backends.emulator import vllm_render as R
from backends.emulator.context import FaceContext
from backends.emulator.vllm_metrics import VllmMetrics

METRICS_KEY = web.AppKey("vllm_metrics", VllmMetrics)


class Reject(Exception):
    """A request vLLM refuses: the status and its error body."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status, self.body = status, body


def bad(message: str, param: str | None = None) -> Reject:
    return Reject(400, R.error_body(message, "BadRequestError", 400, param))


def admit(ctx: FaceContext, metrics: VllmMetrics) -> None:
    """Readiness, injected failures and the admission limit (`--max-num-queued-reqs`), in that order."""
    if not ctx.gate.ready():
        ctx.stats.rejected_not_ready += 1
        raise Reject(503, R.error_body("The server is still starting up.", "ServiceUnavailableError", 503))
    status = ctx.gate.injected_failure()
    if status is not None:
        ctx.stats.failed_injected += 1
        raise Reject(status, R.error_body(
            "Injected failure", R.ERROR_TYPES.get(status, R.PHRASES.get(status, "Error")), status))
    if ctx.gate.queue_full(ctx.snapshot().waiting):
        ctx.stats.rejected_queue_full += 1
        metrics.on_admission_rejected(ctx.model)
        raise Reject(503, R.error_body(R.ADMISSION_MESSAGE, "Service Unavailable", 503))


def json_content_type_error(request: web.Request) -> Reject | None:
    """vLLM's `validate_json_request`: only application/json bodies."""
    ctype = request.headers.get("Content-Type", "")
    if ctype and not ctype.startswith("application/json"):
        return Reject(400, R.error_body(
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed", "Bad Request", 400))
    return None


def prompt_too_long(limit: int) -> Reject:
    # vLLM tokenizes at most max_model_len+1 tokens, hence "at least".
    seen = limit + 1
    return bad(
        f"This model's maximum context length is {limit} tokens. However, your prompt contains at least {seen} "
        "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
        f"input prompt. (parameter=input_tokens, value={seen})", "input_tokens")
