"""Responses API bodies and stream events, field for field, per runtime (pure).

* vLLM 0.32: captured (tests/emulator/captures/vllm-0.32.0-cpu/responses*.txt): the response object
  in `ResponsesResponse` declaration order with vLLM's extras (`presence_penalty` ...
  `output_messages`), `resp_`/`msg_`/`fc_` + 16 hex, usage with the per-turn lists, and
  `response.completed` as the last event even when the status is `incomplete`.
* SGLang: `srt/entrypoints/openai/protocol.py` `ResponsesResponse` (its own field order, a usage
  serializer without the per-turn lists, `reasoning: {effort, summary}`, `store`, `metadata: {}`),
  32-hex ids, and `response.incomplete` instead of `response.completed` when cut by
  `max_output_tokens` (`serving_responses.py`, non-Harmony path).
* trtllm-serve: `tensorrt_llm/serve/openai_protocol.py` (a copy of an older vLLM protocol) and
  `responses_utils.py`; shapes not captured, so the older vLLM field set is an estimate.

Every runtime writes each event as `event: <type>\\ndata: <json>\\n\\n` with `sequence_number`
counting from 0, and the items and events are the OpenAI SDK's pydantic types dumped in full.
"""

from __future__ import annotations

import enum
from typing import Any

import orjson


class Dialect(enum.Enum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


def sse(payload: dict[str, Any]) -> bytes:
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def output_text(text: str, *, logprobs: Any) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message", "phase": None}


def function_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name, "type": "function_call", "id": item_id,
            "async": None, "caller": None, "namespace": None, "status": status}


def _vllm_tool(t: dict[str, Any]) -> dict[str, Any]:
    return {"name": t.get("name"), "parameters": t.get("parameters"), "strict": t.get("strict"), "type": "function",
            "allowed_callers": None, "async": None, "defer_loading": None, "description": t.get("description"),
            "output_schema": None}


def _sglang_tool(t: dict[str, Any]) -> dict[str, Any]:
    return {"type": t.get("type", "function"), "name": t.get("name"), "description": t.get("description"),
            "parameters": t.get("parameters"), "strict": bool(t.get("strict", False)), "tools": None}


def _tool_choice(body: dict[str, Any], tools: list[Any]) -> Any:
    """The echoed `tool_choice`: "none" without tools (as captured), a named function as
    `{"name", "type"}` (the SDK's ToolChoiceFunction order)."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        return {"name": choice.get("name"), "type": "function"}
    if choice is None:
        return "auto" if tools else "none"
    return choice


def _text_config(body: dict[str, Any]) -> dict[str, Any] | None:
    text = body.get("text")
    if not isinstance(text, dict):
        return None
    fmt = text.get("format")
    out_fmt: dict[str, Any] | None = None
    if isinstance(fmt, dict):
        if fmt.get("type") == "json_schema":
            out_fmt = {"name": fmt.get("name"), "schema": fmt.get("schema"), "type": "json_schema",
                       "description": fmt.get("description"), "strict": fmt.get("strict")}
        else:
            out_fmt = {"type": fmt.get("type", "text")}
    return {"format": out_fmt, "verbosity": text.get("verbosity")}


def usage(d: Dialect, prompt: int, completion: int, cached: int, created: int) -> dict[str, Any]:
    if d is Dialect.VLLM:
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": created,
                                         "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                          "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                "total_tokens": prompt + completion}
    if d is Dialect.SGLANG:
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion}
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def response_object(
    d: Dialect, *, rid: str, created_at: int, model: str, body: dict[str, Any], output: list[dict[str, Any]],
    status: str, use: dict[str, Any] | None, max_output_tokens: int,
) -> dict[str, Any]:
    """The whole response object in the runtime's declaration order."""
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    temperature, top_p = body.get("temperature"), body.get("top_p")
    parallel = body.get("parallel_tool_calls", True) is not False
    if d is Dialect.SGLANG:
        text = _text_config(body)
        if text is None and output and all(o.get("type") == "message" for o in output):
            text = {"format": {"type": "text"}}
        return {
            "id": rid, "object": "response", "created_at": created_at, "model": model, "output": output,
            "status": status, "usage": use, "parallel_tool_calls": parallel,
            "tool_choice": _tool_choice(body, tools) if body.get("tool_choice") is not None else "auto",
            "tools": [_sglang_tool(t) for t in tools], "error": None, "incomplete_details": incomplete,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
            "store": body.get("store", True), "temperature": temperature, "text": text, "top_p": top_p,
            "truncation": body.get("truncation", "disabled"), "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }
    out: dict[str, Any] = {
        "id": rid, "created_at": created_at, "incomplete_details": incomplete,
        "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": model,
        "object": "response", "output": output, "parallel_tool_calls": parallel,
        "temperature": 1.0 if temperature is None else float(temperature), "tool_choice": _tool_choice(body, tools),
        "tools": [_vllm_tool(t) for t in tools], "top_p": 1.0 if top_p is None else float(top_p),
        "background": bool(body.get("background", False)), "max_output_tokens": max_output_tokens,
        "max_tool_calls": body.get("max_tool_calls"), "previous_response_id": body.get("previous_response_id"),
        "prompt": None, "reasoning": body.get("reasoning"), "service_tier": body.get("service_tier", "auto"),
        "status": status, "text": _text_config(body), "top_logprobs": None,
        "truncation": body.get("truncation", "disabled"), "usage": use, "user": body.get("user"),
    }
    if d is Dialect.VLLM:
        out.update(presence_penalty=float(body.get("presence_penalty") or 0.0),
                   frequency_penalty=float(body.get("frequency_penalty") or 0.0), kv_transfer_params=None,
                   ec_transfer_params=None, input_messages=None, output_messages=None)
    return out


def final_event_type(d: Dialect, status: str) -> str:
    """vLLM and trtllm-serve always finish with `response.completed`; SGLang with
    `response.incomplete` when the output was cut by `max_output_tokens`."""
    return "response.incomplete" if d is Dialect.SGLANG and status == "incomplete" else "response.completed"


def item_ids(d: Dialect, hex_id: Any) -> tuple[str, str, str]:
    """(message id, function-call item id, call id) in the runtime's formats."""
    if d is Dialect.VLLM:
        return f"msg_{hex_id(16)}", f"fc_{hex_id(16)}", f"chatcmpl-tool-{hex_id(16)}"
    if d is Dialect.SGLANG:
        return f"msg_{hex_id(32)}", f"fc_{hex_id(32)}", f"call_{hex_id(24)}"
    return f"msg_{hex_id(32)}", f"fc_{hex_id(32)}", f"call_{hex_id(24)}"


def response_id(d: Dialect, hex_id: Any) -> str:
    return f"resp_{hex_id(16)}" if d is Dialect.VLLM else f"resp_{hex_id(32)}"

