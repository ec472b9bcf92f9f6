"""The Responses API expressed as chat completions, and chat answers as Responses objects. Pure.

A backend that does not serve `/v1/responses` (Triton, or any runtime configured without it) still
serves a Responses request the gateway can translate: text or message `input` (input_text,
output_text, input_image and input_audio parts), `instructions` (a leading system message),
`function_call` / `function_call_output` items (an assistant message with `tool_calls`, a `tool`
message), `max_output_tokens`, `temperature`, `top_p`, function `tools` and `tool_choice`,
`parallel_tool_calls`, `text.format` (`response_format`) and `reasoning.effort`. What chat cannot
express needs a runtime that serves Responses itself (`untranslatable` says which field):
`previous_response_id` and `conversation` (state kept by the backend), `background`, prompt
templates, built-in tools (web search, file search, MCP ...), file inputs, logprobs.

The answer is built the way OpenAI's Responses objects are (`response_object`), with the ids
`resp_<gateway request id>`, `msg_<...>`, `fc_<...>_<n>` and the chat call ids as `call_id`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends.base import TranslationError, Usage

_PASS = ("temperature", "top_p", "user", "seed")
_IGNORED_TRUE = ("background",)  # fields whose truthy value chat cannot honour
_STATEFUL = ("previous_response_id", "conversation", "prompt")


def untranslatable(body: Mapping[str, Any]) -> str | None:
    """The first field of a Responses request that chat cannot express, or None."""
    for key in _STATEFUL:
        if body.get(key) is not None:
            return key
    for key in _IGNORED_TRUE:
        if body.get(key):
            return key
    top = body.get("top_logprobs")
    if isinstance(top, int) and top > 0:
        return "top_logprobs"
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        return "tools"
    for tool in tools or ():
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return "tools"
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        return "tool_choice"
    try:
        messages(body)
    except TranslationError:
        return "input"
    return None


def _text_part(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        image: dict[str, Any] = {"url": part["image_url"]}
        if isinstance(part.get("detail"), str):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_audio" and isinstance(part.get("input_audio"), dict):
        return {"type": "input_audio", "input_audio": part["input_audio"]}
    raise TranslationError(f"{where}: a {kind!r} part needs a backend that serves /v1/responses")


def _content(content: object, where: str) -> str | list[dict[str, Any]]:
    """Message content for chat: a string when every part is text (what raw-text runtimes render)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TranslationError(f"{where}: content must be a string or a list of parts")
    parts = [_text_part(p, where) if isinstance(p, dict) else {"type": "bad"} for p in content]
    if any(p["type"] == "bad" for p in parts):
        raise TranslationError(f"{where}: every content part must be an object")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a Responses request stands for. Raises TranslationError."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return out
    if not isinstance(items, list):
        raise TranslationError("input must be a string or a list of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise TranslationError(f"{where} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise TranslationError(f"{where}.role must be user, assistant, system or developer")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _content(output, where)})
        else:
            raise TranslationError(f"{where}: a {kind!r} item needs a backend that serves /v1/responses")
    return out


def _tools(tools: object) -> list[dict[str, Any]]:
    out = []
    for tool in tools if isinstance(tools, list) else ():
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object) -> object:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: object) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body for a Responses request. Raises TranslationError."""
    reason = untranslatable(body)
    if reason is not None:
        raise TranslationError(f"'{reason}' needs a backend that serves /v1/responses itself")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages(body)}
    if body.get("stream"):
        chat["stream"] = True
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in _PASS:
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        chat["reasoning_effort"] = reasoning["effort"]
    return chat


def chat_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """A chat-shaped body for routing (prefix hashing over the same rendered messages as chat), best
    effort: input chat cannot express is hashed as its JSON."""
    try:
        return {"messages": messages(body)}
    except TranslationError:
        return {"messages": body.get("input")}


# --- answers ---------------------------------------------------------------------------------------


def usage_object(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens or 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _echo_tools(tools: object) -> list[dict[str, Any]]:
    return [dict(t) for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []


def response_object(
    body: Mapping[str, Any], *, response_id: str, created: int, model: str, status: str,
    output: list[dict[str, Any]], usage: Usage | None,
) -> dict[str, Any]:
    """A Response object (OpenAI's field set) for a translated request."""
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    tools = _echo_tools(body.get("tools"))
    choice = body.get("tool_choice")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": body.get("temperature"),
        "text": {"format": fmt if isinstance(fmt, dict) else {"type": "text"}},
        "tool_choice": choice if choice is not None else ("auto" if tools else "none"),
        "tools": tools,
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": usage_object(usage),
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def status_for(finish_reason: object) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def from_chat(
    chat: Mapping[str, Any], body: Mapping[str, Any], *, request_id: str, created: int, model: str,
    usage: Usage | None,
) -> dict[str, Any]:
    """The Response object for a chat.completion answer to `to_chat(body)`."""
    choices = chat.get("choices")
    choice: Mapping[str, Any] = (
        choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {})
    found = choice.get("message")
    message: Mapping[str, Any] = found if isinstance(found, dict) else {}
    output: list[dict[str, Any]] = []
    content = message.get("content")
    if isinstance(content, str) and content:
        output.append(message_item(f"msg_{request_id}", content))
    for n, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            output.append(call_item(f"fc_{request_id}_{n}", str(call.get("id") or f"call_{request_id}_{n}"),
                                    str(function.get("name") or ""), str(function.get("arguments") or "")))
    if not output:
        output.append(message_item(f"msg_{request_id}", ""))
    return response_object(body, response_id=f"resp_{request_id}", created=created, model=model,
                           status=status_for(choice.get("finish_reason")), output=output, usage=usage)
