"""What the trtllm-serve face's modules share: version, error bodies, admission checks."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from backends.emulator.context import FaceContext
from backends.emulator.openai_common import flat_error
from backends.emulator.trtllm_metrics import TrtllmMetrics

VERSION = "1.2.0"
METRICS_KEY = web.AppKey("trtllm_metrics", TrtllmMetrics)


class Reject(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status, self.body = status, body


def flat(message: str, err_type: str, code: int) -> Reject:
    return Reject(code, flat_error(code, message, err_type))


def pydantic(model: str, loc: str, msg: str, kind: str, value: Any) -> Reject:
    text = (f"1 validation error for {model}\n{loc}\n  {msg} [type={kind}, input_value={value!r}, "
            f"input_type={type(value).__name__}]\n    For further information visit "
            f"https://errors.pydantic.dev/2.11/v/{kind}")
    return Reject(400, {"error": text})


def admit(ctx: FaceContext) -> None:
    if not ctx.gate.ready():
        ctx.stats.rejected_not_ready += 1
        raise flat("LLM is unavailable. Please check the server logs for more details.", "ServiceUnavailableError",
                    503)
    status = ctx.gate.injected_failure()
    if status is not None:
        ctx.stats.failed_injected += 1
        raise flat("Injected failure", "InternalServerError" if status >= 500 else "BadRequestError", status)
    if ctx.gate.queue_full(ctx.snapshot().waiting):
        ctx.stats.rejected_queue_full += 1
        raise flat("The request queue is full.", "ServiceUnavailableError", 503)
