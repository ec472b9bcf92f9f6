"""Render OpenAI chat messages to one prompt string, for runtimes that take raw text (Triton).

Triton's TensorRT-LLM ensemble applies no chat template, so the gateway must. We cannot run the
model's Jinja template (no tokenizer here), so three fixed renderings cover the common model
families; each ends with the assistant generation prompt (`add_generation_prompt=True`).

`llama3` omits `<|begin_of_text|>`: Triton's preprocessing model tokenizes with special tokens on by
default and would add a second BOS.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from backends.base import TranslationError

TEMPLATES: Final = ("chatml", "llama3", "plain")


def message_text(message: Mapping[str, Any], index: int) -> str:
    """The text of one message: a string, null, or a list of `text` parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TranslationError(f"messages[{index}].content: only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise TranslationError(f"messages[{index}].content must be a string or a list of text parts")


def _turns(messages: object) -> list[tuple[str, str]]:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise TranslationError("messages must be a non-empty list")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TranslationError(f"messages[{i}] must be an object with a string role")
        role = message["role"]
        turns.append(("system" if role == "developer" else role, message_text(message, i)))
    return turns


def _chatml(turns: list[tuple[str, str]]) -> str:
    body = "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)
    return body + "<|im_start|>assistant\n"


def _llama3(turns: list[tuple[str, str]]) -> str:
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    body = "".join(head.format(role) + text.strip() + "<|eot_id|>" for role, text in turns)
    return body + head.format("assistant")


def _plain(turns: list[tuple[str, str]]) -> str:
    body = "".join(f"{role.capitalize()}: {text}\n" for role, text in turns)
    return body + "Assistant:"


_RENDERERS: dict[str, Callable[[list[tuple[str, str]]], str]] = {
    "chatml": _chatml,
    "llama3": _llama3,
    "plain": _plain,
}


def render(messages: object, template: str = "chatml") -> str:
    """Render `messages` with `template`; raises TranslationError for content it cannot express."""
    try:
        renderer = _RENDERERS[template]
    except KeyError:
        raise ValueError(f"unknown chat template {template!r}; expected one of {TEMPLATES}") from None
    return renderer(_turns(messages))
