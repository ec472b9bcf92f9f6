"""Chat messages -> the prompt text the engine renders, with the model's own Jinja chat template.

Rendered as transformers' `apply_chat_template` does (which vLLM and SGLang call): a sandboxed,
immutable Jinja environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a
`{% generation %}` block that renders its body, `raise_exception`, `strftime_now`, and a `tojson`
filter that does not escape HTML; the template sees `messages`, `tools`, `documents`,
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, ...) and the
request's `chat_template_kwargs`.

The messages are first normalised as vLLM 0.32 does (`vllm/renderers/chat_utils.py`): content
parts of type `text` are joined with a newline when the template reads `content` as a string, or
kept as `[{"type": "text", "text": ...}]` when it iterates over it; an assistant's tool-call
`arguments` become objects (`{}` when missing or not a JSON object); `tool_call_id`, `name` and
`reasoning` are passed on. Anything the gateway cannot reproduce exactly (images, audio,
`continue_final_message`, a `developer` role the template does not know) raises `Unrenderable`,
and the caller falls back to the approximate prefix index: a wrong token sequence would be worse
than none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Unrenderable(ValueError):
    """A request whose prompt the gateway cannot render exactly as the engine would."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# A template that loops over a message's content expects OpenAI-style parts (vLLM's "openai"
# content format); one that prints it expects a string. vLLM decides this from the template's AST;
# the loop is what that analysis finds.
_ITERATES_CONTENT = re.compile(r"for\s+\w+\s+in\s+(?:message|msg|m)\s*(?:\[\s*['\"]content['\"]\s*\]|\.content)")


class ChatTemplate:
    """One model's chat template, compiled once."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.openai_content = bool(_ITERATES_CONTENT.search(source))
        self.knows_developer = "developer" in source

    def render(self, body: Mapping[str, Any]) -> str:
        """The prompt text of a chat completions `body`; raises Unrenderable."""
        if body.get("continue_final_message"):
            raise Unrenderable("continue_final_message")
        conversation = normalise(body.get("messages"), openai_content=self.openai_content)
        if not self.knows_developer and any(m["role"] == "developer" for m in conversation):
            raise Unrenderable("a developer message the template does not know")
        extra = body.get("chat_template_kwargs")
        kwargs: dict[str, Any] = dict(extra) if isinstance(extra, dict) else {}
        tools = body.get("tools")
        agp = body.get("add_generation_prompt", True)
        try:
            return self._template.render(
                **self.special_tokens,
                **{k: v for k, v in kwargs.items() if k not in _RESERVED},
                messages=conversation,
                tools=tools if isinstance(tools, list) and tools else None,
                documents=body.get("documents"),
                add_generation_prompt=bool(agp),
            )
        except jinja2.TemplateError as exc:  # the template refused the request: the engine will too
            raise Unrenderable(f"the chat template refused the request: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise Unrenderable(f"the chat template failed: {exc}") from exc


_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _texts(content: Any, index: int) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise Unrenderable(f"messages[{index}].content")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:  # images, audio, files, refusals: token ids the gateway cannot reproduce
            raise Unrenderable(f"messages[{index}].content: a non-text part")
    return texts


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if not raw:
        return {}
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def normalise(messages: Any, *, openai_content: bool) -> list[dict[str, Any]]:
    """vLLM's conversation for `messages` (see the module docstring); raises Unrenderable."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise Unrenderable("messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise Unrenderable(f"messages[{i}]")
        role = message["role"]
        texts = _texts(message.get("content"), i)
        msg: dict[str, Any] = {"role": role}
        if openai_content and role != "tool":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(texts)
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                fixed = []
                for call in calls:
                    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
                        raise Unrenderable(f"messages[{i}].tool_calls")
                    function = dict(call["function"])
                    function["arguments"] = _arguments(function.get("arguments"))
                    fixed.append({**call, "function": function})
                msg["tool_calls"] = fixed
            reasoning = message.get("reasoning")
            if isinstance(reasoning, str):
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            msg["tool_call_id"] = message["tool_call_id"]
        name = message.get("name")
        if isinstance(name, str):
            msg["name"] = name
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    return out
