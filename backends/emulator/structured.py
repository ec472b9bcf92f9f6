"""Constrained outputs: forced tool calls and `response_format` / `text.format` JSON.

A request's *shape* says what the output must be: free text (the default, also for
`tool_choice: "auto"`, where a model may answer with text), JSON valid against a schema
(`response_format` json_object/json_schema, Responses `text.format`), or a call of one function
(`tool_choice: "required"` or a named function) whose arguments are valid against the function's
`parameters`. The emulator decides the whole output text up front (see `textgen`): the minimal
schema instance (`schema_instance`), serialised with `json.dumps` defaults (`", "`, `": "`), as
vLLM re-serialises parsed tool arguments.

A tool call is generated as the runtime's raw text (a wrapper around the arguments, as the tool
parser sees it); `ToolCallLayout` says which characters are the wrapper and which the arguments,
so each face can stream the name once the wrapper is complete and the arguments piece by piece.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from backends.emulator.schema_instance import instance

ShapeKind = Literal["text", "json", "tool"]


class ShapeError(ValueError):
    """The request asks for an impossible shape (e.g. a named tool that is not in `tools`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    parameters: Any  # the JSON schema of the arguments (None: any object)


@dataclass(frozen=True, slots=True)
class OutputShape:
    kind: ShapeKind = "text"
    schema: Any = None  # "json": the schema the content must match
    tool: ToolSpec | None = None  # "tool": the function to call
    named: bool = False  # "tool": forced by name (vLLM then finishes with "stop", not "tool_calls")

    def json_text(self) -> str:
        """The content ("json") or the arguments ("tool") the output carries."""
        if self.kind == "tool" and self.tool is not None:
            params = self.tool.parameters if self.tool.parameters is not None else {"type": "object"}
            return json.dumps(instance(params))
        return json.dumps(instance(self.schema if self.schema is not None else {"type": "object"}))


TEXT = OutputShape()
_NOT_FOUND_RESPONSES = "Tool choice 'function' not found in 'tools' parameter."


def _tool_list(raw: Any, *, nested: bool) -> list[ToolSpec]:
    """Function tools of a chat (`{"type":"function","function":{...}}`) or Responses (flat) body."""
    out: list[ToolSpec] = []
    for t in raw if isinstance(raw, list) else []:
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            continue
        fn = t.get("function") if nested else t
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.append(ToolSpec(fn["name"], fn.get("parameters")))
    return out


def _choose_tool(tools: list[ToolSpec], choice: Any, *, nested: bool) -> OutputShape | None:
    """The forced call `tool_choice` asks for; messages as vLLM 0.32's `check_tool_usage` words them
    (chat: `chat_completion/protocol.py`; Responses, `nested=False`: `responses/protocol.py`)."""
    if (choice == "required" or isinstance(choice, dict)) and not tools:
        if nested:
            raise ShapeError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if choice == "required":
            raise ShapeError("Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice")
        raise ShapeError(_NOT_FOUND_RESPONSES, "tool_choice")
    if choice == "required":
        return OutputShape("tool", tool=tools[0])
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function") if nested else choice
        name = fn.get("name") if isinstance(fn, dict) else None
        for t in tools:
            if t.name == name:
                return OutputShape("tool", tool=t, named=True)
        if not nested:
            raise ShapeError(_NOT_FOUND_RESPONSES, "tool_choice")
        raise ShapeError("The tool specified in `tool_choice` does not match any of the specified `tools`",
                         "tool_choice")
    return None


def chat_shape(body: dict[str, Any]) -> OutputShape:
    """The shape a chat completions body asks for (`tools`/`tool_choice`, `response_format`)."""
    return _shape(body, body.get("response_format"), nested=True)


def responses_shape(body: dict[str, Any]) -> OutputShape:
    """The shape a Responses body asks for (`tools`/`tool_choice`, `text.format`)."""
    text = body.get("text")
    return _shape(body, text.get("format") if isinstance(text, dict) else None, nested=False)


def _shape(body: dict[str, Any], fmt: Any, *, nested: bool) -> OutputShape:
    """A forced tool call, else the JSON output format `fmt` asks for, else text. A chat
    `response_format` nests the schema (`json_schema.schema`); a Responses `text.format`
    (`nested=False`) holds it beside `type`."""
    tools = _tool_list(body.get("tools"), nested=nested)
    forced = _choose_tool(tools, body.get("tool_choice"), nested=nested)
    if forced is not None:
        return forced
    if isinstance(fmt, dict):
        if fmt.get("type") == "json_object":
            return OutputShape("json", schema={"type": "object"})
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema") if nested else fmt
            schema = spec.get("schema") if isinstance(spec, dict) else None
            return OutputShape("json", schema=schema if schema is not None else {"type": "object"})
    return TEXT


@dataclass(frozen=True, slots=True)
class ToolCallLayout:
    """A tool call's raw text: `prefix` (names the function) + `arguments` + `suffix`."""

    name: str
    prefix: str
    arguments: str
    suffix: str

    @property
    def text(self) -> str:
        return self.prefix + self.arguments + self.suffix

    def complete(self, generated: int) -> bool:
        """Whether `generated` characters of the raw text contain the whole call."""
        return generated >= len(self.text)


def hermes_layout(name: str, arguments: str) -> ToolCallLayout:
    """The Hermes format vLLM (`--tool-call-parser hermes`) and trtllm-serve parse."""
    prefix = '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '
    return ToolCallLayout(name, prefix, arguments, "}\n</tool_call>")


def json_array_layout(name: str, arguments: str) -> ToolCallLayout:
    """SGLang's constrained output for required/named tool choice (its JsonArrayParser)."""
    return ToolCallLayout(name, '[{"name": ' + json.dumps(name) + ', "parameters": ', arguments, "}]")


class ToolCallStream:
    """Turns the raw tool-call text, piece by piece, into what a runtime streams: the function name
    once the prefix is complete, then each fragment of the arguments; the wrapper itself never."""

    def __init__(self, layout: ToolCallLayout) -> None:
        self.layout = layout
        self._seen = 0
        self.name_sent = False

    def feed(self, piece: str) -> tuple[bool, str]:
        """Consume one piece; returns (the name becomes known now, the arguments fragment in it)."""
        start, self._seen = self._seen, self._seen + len(piece)
        lo, hi = len(self.layout.prefix), len(self.layout.prefix) + len(self.layout.arguments)
        name_now = not self.name_sent and self._seen >= lo
        if name_now:
            self.name_sent = True
        fragment = self.layout.text[max(start, lo) : min(self._seen, hi)] if self._seen > lo and start < hi else ""
        return name_now, fragment

    @property
    def complete(self) -> bool:
        return self.layout.complete(self._seen)

    @property
    def arguments_so_far(self) -> str:
        lo = len(self.layout.prefix)
        return self.layout.arguments[: max(0, min(self._seen - lo, len(self.layout.arguments)))]
