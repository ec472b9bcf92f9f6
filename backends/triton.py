"""Triton Inference Server + TensorRT-LLM ensemble, through the KServe `generate` extension.

Triton does not speak OpenAI, so this adapter translates both ways (spec 4.2.4): chat messages are
rendered to `text_input` with a fixed chat template, sampling fields are mapped to ensemble inputs,
and the answer (one JSON object, or SSE events carrying only new text and no `[DONE]`) is turned into
OpenAI objects with synthesised ids, finish_reason and usage. Fields Triton cannot honour (tools,
n > 1, logprobs, JSON modes, echo, suffix) are refused with TranslationError instead of ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import orjson

from backends import chat_templates, prom
from backends.base import (
    ClientRequest,
    Endpoint,
    ErrorBody,
    Load,
    LoadParseError,
    Probe,
    Reply,
    Runtime,
    TranslationError,
    UpstreamFormatError,
    UpstreamRequest,
    Usage,
)
from backends.openai_compat import normalise_error
from backends.triton_stream import TritonStreamTranslator, as_count, as_text, estimate_tokens, finish_reason

DEFAULT_MAX_TOKENS = {Endpoint.CHAT: 512, Endpoint.COMPLETIONS: 16}
_FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_UNSUPPORTED = ("tools", "logprobs", "echo", "suffix", "logit_bias")


@dataclass(frozen=True, slots=True)
class TritonPlan:
    """The translated request plus what the response side needs to finish the job."""

    body: dict[str, Any]
    text_input: str
    max_tokens: int


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TranslationError(f"{key} must be a number")
    return float(value)


def _integer(body: dict[str, Any], key: str, *, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TranslationError(f"{key} must be an integer >= {minimum}")
    return value


def _text_input(req: ClientRequest, template: str) -> str:
    if req.endpoint is Endpoint.CHAT:
        return chat_templates.render(req.body.get("messages"), template)
    prompt = req.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise TranslationError("prompt must be a string (or a list of one string) for this backend")
    return prompt


def _stop_words(stop: object) -> list[str] | str:
    if stop is None or stop == []:
        return ""
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise TranslationError("stop must be a string or a list of strings")


def plan(req: ClientRequest, template: str) -> TritonPlan:
    """Translate a client request into a generate-extension body. Raises TranslationError."""
    if req.endpoint not in DEFAULT_MAX_TOKENS:  # Responses come through the gateway's chat translation
        raise TranslationError(f"/{req.endpoint} is not served by this backend (Triton)")
    b = req.body
    for key in _UNSUPPORTED:
        if b.get(key):
            raise TranslationError(f"{key} is not supported by this backend (Triton)")
    if b.get("n") not in (None, 1):
        raise TranslationError("n > 1 is not supported by this backend (Triton)")
    fmt = b.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise TranslationError("response_format other than text is not supported by this backend (Triton)")
    text = _text_input(req, template)
    max_tokens = _integer(b, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _integer(b, "max_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS[req.endpoint]
    body: dict[str, Any] = {
        "text_input": text,
        "max_tokens": max_tokens,
        "stream": req.stream,
        "bad_words": "",
        "stop_words": _stop_words(b.get("stop")),
        "exclude_input_in_output": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }
    for key in _FLOAT_FIELDS:
        value = _number(b, key)
        if value is not None:
            body[key] = value
    top_k = _integer(b, "top_k", minimum=-1)
    if top_k is not None and top_k > 0:  # 0 and -1 mean "disabled" in the OpenAI-extension dialects
        body["top_k"] = top_k
    if body.get("temperature") == 0.0:  # greedy, expressed the way TRT-LLM samplers accept
        del body["temperature"]
        body["top_k"] = 1
    for key in ("seed", "min_tokens"):
        value = _integer(b, key, minimum=0)
        if value is not None:
            body[key] = value
    return TritonPlan(body=body, text_input=text, max_tokens=max_tokens)


class TritonAdapter:
    """Stateless; `chat_template` picks how chat messages become `text_input`."""

    __slots__ = ("chat_template", "runtime")

    def __init__(self, *, chat_template: str = "chatml") -> None:
        if chat_template not in chat_templates.TEMPLATES:
            raise ValueError(f"unknown chat template {chat_template!r}")
        self.runtime = Runtime.TRITON
        self.chat_template = chat_template

    @property
    def liveness(self) -> Probe:
        return Probe("/v2/health/live")

    @property
    def readiness(self) -> Probe:
        return Probe("/v2/health/ready")  # 400 (not 503) means not ready: anything but 200 fails

    @property
    def load_path(self) -> str:
        """On Triton's metrics port (8002 by default), not its HTTP port."""
        return "/metrics"

    def parse_load(self, body: bytes, previous: Load | None) -> Load:
        m = prom.parse(body)
        requests = "nv_trt_llm_request_metrics"
        blocks = "nv_trt_llm_kv_cache_block_metrics"
        waiting = m.sum(requests, {"request_type": "waiting"})
        if waiting is None:  # older backends lack `waiting`; per-model pending counts are the fallback
            pending = m.select("nv_inference_pending_request_count")
            waiting = max(s.value for s in pending) if pending else None
        running = m.sum(requests, {"request_type": "scheduled"})
        if running is None:
            running = m.sum(requests, {"request_type": "active"})
        kv = m.sum(blocks, {"kv_cache_block_type": "fraction"})
        if kv is None:
            used, total = (
                m.sum(blocks, {"kv_cache_block_type": "used"}),
                m.sum(blocks, {"kv_cache_block_type": "max"}),
            )
            kv = used / total if used is not None and total else None
        if running is None and waiting is None and kv is None:
            raise LoadParseError("no TensorRT-LLM metrics (is load_path on Triton's metrics port?)")
        return Load(
            running=running,
            waiting=waiting,
            kv_usage=kv,
            block_size=prom.to_int(m.sum(blocks, {"kv_cache_block_type": "tokens_per"})),
        )

    def build_request(self, req: ClientRequest, *, model: str, request_id: str) -> UpstreamRequest:
        p = plan(req, self.chat_template)
        action = "generate_stream" if req.stream else "generate"
        return UpstreamRequest(
            path=f"/v2/models/{quote(model, safe='')}/{action}",
            body=orjson.dumps(p.body),
            headers={"content-type": "application/json", "x-request-id": request_id},
        )

    def stream_translator(self, req: ClientRequest, *, model: str, request_id: str) -> TritonStreamTranslator:
        p = plan(req, self.chat_template)
        return TritonStreamTranslator(
            chat=req.endpoint is Endpoint.CHAT,
            model=model,
            request_id=request_id,
            created=req.created or 0,
            max_tokens=p.max_tokens,
            prompt_tokens_estimate=estimate_tokens(p.text_input),
        )

    def translate_response(
        self, req: ClientRequest, status: int, body: bytes, *, model: str, request_id: str
    ) -> Reply:
        """A full chat.completion / text_completion with id `chatcmpl-<request_id>` and usage."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise UpstreamFormatError(f"Triton response is not JSON: {exc}") from exc
        if not isinstance(obj, dict) or "text_output" not in obj:
            raise UpstreamFormatError("Triton response has no text_output")
        p = plan(req, self.chat_template)
        text = as_text(obj["text_output"])
        completion = as_count(obj.get("num_output_tokens"))
        if completion is None:
            completion = estimate_tokens(text)
        prompt = as_count(obj.get("num_input_tokens"))
        if prompt is None:
            prompt = estimate_tokens(p.text_input)
        rid = request_id
        reason = finish_reason(completion, p.max_tokens)
        chat = req.endpoint is Endpoint.CHAT
        choice: dict[str, Any] = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
            if chat
            else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        )
        out = orjson.dumps(
            {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                "object": "chat.completion" if chat else "text_completion",
                "created": req.created or 0,
                "model": model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            }
        )
        return Reply(out, Usage(prompt_tokens=prompt, completion_tokens=completion))

    def normalise_error(self, status: int, body: bytes) -> ErrorBody:
        return normalise_error(status, body)
