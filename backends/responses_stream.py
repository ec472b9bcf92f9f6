"""A chat completions stream as a Responses stream, incrementally. Pure.

Input is OpenAI chat SSE (`data: {chunk}` ... `data: [DONE]`, possibly produced by another
translator, e.g. Triton's); output is the Responses event sequence OpenAI's SDK reads, each event
`event: <type>` + `data: <json>` with `sequence_number` from 0: `response.created`,
`response.in_progress`, then per output item `response.output_item.added`, (text)
`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, (function call) `response.function_call_arguments.delta`...,
`response.function_call_arguments.done`, and `response.output_item.done`, and last
`response.completed` with the usage (also when the status is `incomplete`, as vLLM and trtllm-serve
do, so the SDK's `get_final_response()` works). A chat error event becomes an `error` event
(carrying OpenAI's `error` object too, so the SDK raises `APIError`), and then nothing more.

Bytes arrive split anywhere; only complete events are interpreted, so the output is a pure function
of the concatenated input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from backends.base import ErrorBody, StreamTranslator, Usage
from backends.openai_compat import parse_usage
from backends.responses_chat import call_item, message_item, response_object, status_for


def event(payload: dict[str, Any]) -> bytes:
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def error_event(error: ErrorBody, sequence_number: int) -> bytes:
    """A Responses `error` event that also carries OpenAI's `error` object (the SDK raises on it)."""
    return event({"type": "error", "sequence_number": sequence_number, "code": error.code,
                  "message": error.message, "param": error.param, "error": error.as_dict()["error"]})


class _Item:
    __slots__ = ("arguments", "call_id", "id", "index", "kind", "name", "text")

    def __init__(self, kind: str, item_id: str, index: int, *, call_id: str = "", name: str = "") -> None:
        self.kind = kind
        self.id = item_id
        self.index = index
        self.call_id = call_id
        self.name = name
        self.text = ""
        self.arguments = ""

    def final(self) -> dict[str, Any]:
        if self.kind == "message":
            return message_item(self.id, self.text)
        return call_item(self.id, self.call_id, self.name, self.arguments)


class ChatToResponsesStream:
    """One per request: `feed` the chat SSE bytes that arrived, get the Responses events ready now."""

    def __init__(
        self, inner: StreamTranslator | None, body: Mapping[str, Any], *, model: str, request_id: str, created: int,
    ) -> None:
        self._inner = inner
        self._body = body
        self._model = model
        self._rid = request_id
        self._created = created
        self._buf = b""
        self._seq = 0
        self._started = False
        self._items: list[_Item] = []
        self._open: _Item | None = None  # the item receiving deltas
        self._calls: dict[int, _Item] = {}  # chat tool-call index -> its item
        self._finish: object = None
        self._usage: Usage | None = None
        self._done = False  # [DONE] seen
        self._failed = False
        self._closed = False

    def feed(self, data: bytes) -> bytes:
        if self._closed:
            return b""
        if self._inner is not None:
            data = self._inner.feed(data)
        return self._consume(data)

    def close(self) -> bytes:
        if self._closed:
            return b""
        out = self._consume(self._inner.close()) if self._inner is not None else b""
        rest, self._buf = self._buf, b""
        if rest.strip():
            out += self._consume(rest + b"\n\n")
        self._closed = True
        if self._done and not self._failed:
            out += self._finish_events()
        return out

    # -- internals ------------------------------------------------------------------------------

    def _consume(self, data: bytes) -> bytes:
        buf = (self._buf + data).replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2:]
        out = bytearray()
        for block in buf[:end].split(b"\n\n"):
            payload = b"\n".join(line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:"))
            if payload:
                out += self._chunk(payload)
        return bytes(out)

    def _emit(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self._seq
        self._seq += 1
        return event(payload)

    def _response(self, status: str, output: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
        return response_object(self._body, response_id=f"resp_{self._rid}", created=self._created, model=self._model,
                               status=status, output=output, usage=usage)

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        head = self._response("in_progress", [], None)
        return (self._emit({"type": "response.created", "response": head})
                + self._emit({"type": "response.in_progress", "response": head}))

    def _chunk(self, payload: bytes) -> bytes:
        if self._failed or self._done:
            return b""
        if payload.strip() == b"[DONE]":
            self._done = True
            return self._start()
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return self._fail(ErrorBody("Malformed event from backend", "server_error"))
        if not isinstance(obj, dict):
            return self._fail(ErrorBody("Malformed event from backend", "server_error"))
        if "error" in obj:
            err = obj["error"]
            if isinstance(err, dict):
                code = err.get("code")
                return self._fail(ErrorBody(str(err.get("message") or "Backend error"),
                                            str(err.get("type") or "server_error"),
                                            err.get("param") if isinstance(err.get("param"), str) else None,
                                            code if isinstance(code, str | int) else None))
            return self._fail(ErrorBody(str(err or "Backend error"), "server_error"))
        out = self._start()
        usage = parse_usage(obj)
        if usage is not None:
            self._usage = usage
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                text = delta.get("content")
                if isinstance(text, str) and text:
                    out += self._text(text)
                for call in delta.get("tool_calls") or ():
                    if isinstance(call, dict):
                        out += self._call(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return out

    def _fail(self, error: ErrorBody) -> bytes:
        self._failed = True
        out = self._start() + error_event(error, self._seq)
        self._seq += 1
        return out

    def _added(self, item: _Item) -> bytes:
        out = self._close_open()
        self._items.append(item)
        self._open = item
        status = "in_progress"
        added = (message_item(item.id, "", status) if item.kind == "message"
                 else call_item(item.id, item.call_id, item.name, "", status))
        out += self._emit({"type": "response.output_item.added", "output_index": item.index, "item": added})
        if item.kind == "message":
            out += self._emit({"type": "response.content_part.added", "item_id": item.id, "output_index": item.index,
                               "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
        return out

    def _text(self, text: str) -> bytes:
        out = b""
        item = self._open
        if item is None or item.kind != "message":
            n = sum(i.kind == "message" for i in self._items)
            item = _Item("message", f"msg_{self._rid}" + (f"_{n}" if n else ""), len(self._items))
            out += self._added(item)
        item.text += text
        return out + self._emit({"type": "response.output_text.delta", "item_id": item.id, "output_index": item.index,
                                 "content_index": 0, "delta": text, "logprobs": []})

    def _call(self, call: Mapping[str, Any]) -> bytes:
        out = b""
        index = call.get("index", 0)
        key = index if isinstance(index, int) else 0
        found = call.get("function")
        function: Mapping[str, Any] = found if isinstance(found, dict) else {}
        item = self._calls.get(key)
        if item is None:
            n = len(self._calls)
            item = _Item("function_call", f"fc_{self._rid}_{n}", len(self._items),
                         call_id=str(call.get("id") or f"call_{self._rid}_{n}"), name=str(function.get("name") or ""))
            self._calls[key] = item
            out += self._added(item)
        pieces = function.get("arguments")
        if isinstance(pieces, str) and pieces:
            item.arguments += pieces
            out += self._emit({"type": "response.function_call_arguments.delta", "item_id": item.id,
                               "output_index": item.index, "delta": pieces})
        return out

    def _close_open(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        out = b""
        if item.kind == "message":
            part = {"type": "output_text", "text": item.text, "annotations": []}
            out += self._emit({"type": "response.output_text.done", "item_id": item.id, "output_index": item.index,
                               "content_index": 0, "text": item.text, "logprobs": []})
            out += self._emit({"type": "response.content_part.done", "item_id": item.id, "output_index": item.index,
                               "content_index": 0, "part": part})
        else:
            out += self._emit({"type": "response.function_call_arguments.done", "item_id": item.id,
                               "output_index": item.index, "name": item.name, "arguments": item.arguments})
        return out + self._emit({"type": "response.output_item.done", "output_index": item.index,
                                 "item": item.final()})

    def _finish_events(self) -> bytes:
        out = self._close_open()
        output = [i.final() for i in self._items] or [message_item(f"msg_{self._rid}", "")]
        final = self._response(status_for(self._finish), output, self._usage)
        return out + self._emit({"type": "response.completed", "response": final})
