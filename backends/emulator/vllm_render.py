"""vLLM 0.32 response bodies, field for field in pydantic declaration order (see the captures in
/work/shared/captures/vllm-0.32.0-cpu): nulls included in full responses, `exclude_unset` in chunks."""

from __future__ import annotations

import random
from typing import Any

from backends.emulator.openai_common import ChatRequest

VERSION = "0.32.0"
PHRASES = {
    400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout", 429: "Too Many Requests",
    500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout",
}
ERROR_TYPES = {
    400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError", 500: "InternalServerError",
    501: "NotImplementedError", 503: "ServiceUnavailableError",
}
ADMISSION_MESSAGE = (
    "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def validation_error(kind: str, loc: str, msg: str, inp: Any, ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    """FastAPI's RequestValidationError as vLLM renders it: the pydantic error dict's Python repr."""
    err: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": inp}
    if ctx is not None:
        err["ctx"] = ctx
    return error_body(f"1 validation error:\n  {err!r}", "Bad Request", 400, loc)


def logprobs_content(rng: random.Random, pieces: list[str], top: int) -> dict[str, Any]:
    content = []
    for p in pieces:
        lp = -rng.uniform(0.01, 9.0)
        entry: dict[str, Any] = {"token": p, "logprob": lp, "bytes": list(p.encode())}
        tops = [{"token": p, "logprob": lp, "bytes": list(p.encode())}]
        for _ in range(max(0, top - 1)):
            alt = f" alt{rng.randrange(100)}"
            tops.append({"token": alt, "logprob": lp - rng.uniform(0.1, 2.0), "bytes": list(alt.encode())})
        entry["top_logprobs"] = tops[: max(top, 0)]
        content.append(entry)
    return {"content": content}


def usage(
    prompt: int, completion: int, cached: int, created_cache: int | None, *, full: bool
) -> dict[str, Any]:
    """Usage in vLLM key order. `full` = non-streaming (nulls kept); otherwise `exclude_none`."""
    u: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    details: dict[str, Any] = {"cached_tokens": cached, "created_cache_tokens": created_cache}
    if full:
        details["multimodal_tokens"] = None
        u["prompt_tokens_details"] = details
        u["completion_tokens_details"] = None
    else:
        u["prompt_tokens_details"] = {k: v for k, v in details.items() if v is not None}
    return u


def running_usage(prompt: int, completion: int) -> dict[str, Any]:
    """`continuous_usage_stats` usage: no cached details."""
    return {
        "prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
        "completion_tokens_details": None,
    }


def chat_choice(
    index: int, text: str, finish: str, stop_reason: str | None, logprobs: Any,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A chat choice; with `tool_calls` the content is "" and the calls sit before `reasoning`
    (captured: chat_tool_required.txt)."""
    message: dict[str, Any] = {
        "role": "assistant", "content": "" if tool_calls else text, "refusal": None, "annotations": None,
        "audio": None, "function_call": None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    message["reasoning"] = None
    return {
        "index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
        "stop_reason": stop_reason, "token_ids": None, "routed_experts": None,
    }


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_name_delta(call_id: str, name: str) -> dict[str, Any]:
    """The first streamed tool-call delta: id, type and name, no arguments key."""
    call = {"id": call_id, "type": "function", "index": 0, "function": {"name": name}}
    return {"content": None, "tool_calls": [call]}


def tool_args_delta(fragment: str) -> dict[str, Any]:
    return {"content": None, "tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}


def completion_choice(index: int, text: str, finish: str, stop_reason: str | None, logprobs: Any) -> dict[str, Any]:
    return {
        "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason,
        "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None,
    }


def full_response(
    req: ChatRequest, rid: str, created: int, model: str, fingerprint: str, choices: list[dict[str, Any]],
    use: dict[str, Any],
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": created,
        "model": model, "choices": choices, "service_tier": None, "system_fingerprint": fingerprint, "usage": use,
    }
    if req.chat:
        body["prompt_logprobs"] = None
        body["prompt_token_ids"] = None
        body["prompt_text"] = None
    body["kv_transfer_params"] = None
    body["ec_transfer_params"] = None
    body["metrics"] = None
    return body


def model_card(model: str, created: int, max_model_len: int, perm_id: str) -> dict[str, Any]:
    return {
        "id": model, "object": "model", "created": created, "owned_by": "vllm", "root": f"/models/{model}",
        "parent": None, "max_model_len": max_model_len,
        "permission": [{
            "id": f"modelperm-{perm_id}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False,
        }],
    }
