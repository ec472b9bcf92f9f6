"""The Responses API request, read into what the engine needs (pure; no I/O).

`input` is a string or a list of items; each item becomes a chat message: message items (with or
without `"type": "message"`, content a string or `input_text`/`output_text` parts), `function_call`
items (the assistant's call, rendered as its arguments) and `function_call_output` items (a `tool`
message). `instructions` become a leading system message. The runtimes then apply the model's chat
template exactly as for chat completions, so a Responses call and the equivalent chat call have the
same prompt tokens and hit the same prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.emulator import tokenizer
from backends.emulator.structured import OutputShape, responses_shape


class InputError(ValueError):
    """`input` (or an item in it) is not something a Responses request may carry."""

    def __init__(self, message: str, param: str = "input") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ResponsesCall:
    body: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation the prompt is rendered from (instructions first)
    prompt: list[int]
    max_output_tokens: int | None
    stream: bool
    shape: OutputShape


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    if content is None:
        return ""
    raise InputError("Invalid content in input item.")


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """The chat messages a Responses `input` stands for."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise InputError("Input should be a valid string or a valid list of input items.")
    out: list[dict[str, Any]] = []
    for item in raw:
        if not isinstance(item, dict):
            raise InputError("Input items should be objects.")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": str(item.get("role", "user")), "content": _text(item.get("content"))})
        elif kind == "function_call":
            out.append({"role": "assistant", "content": str(item.get("arguments", ""))})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": _text(item.get("output"))})
        elif kind == "reasoning":
            continue  # reasoning items are dropped from the prompt, as the runtimes' templates do
        else:
            raise InputError(f"Unknown input item type: {kind!r}.")
    return out


def read_call(body: dict[str, Any], *, history: Sequence[dict[str, Any]] = ()) -> ResponsesCall:
    """Read a Responses body; `history` is a stored conversation (`previous_response_id`).
    Raises `InputError` for a malformed `input` and `structured.ShapeError` for a bad `tool_choice`."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(history)
    messages.extend(input_messages(body.get("input")))
    raw_max = body.get("max_output_tokens")
    max_output = raw_max if isinstance(raw_max, int) and not isinstance(raw_max, bool) else None
    prompt = tokenizer.encode(tokenizer.render_chat(messages))
    return ResponsesCall(body, messages, prompt, max_output, bool(body.get("stream", False)), responses_shape(body))
