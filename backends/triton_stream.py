"""Triton `generate_stream` SSE -> OpenAI SSE, incrementally.

Bytes arrive split anywhere (inside an event, a line ending or a UTF-8 sequence), so input is
buffered and only complete lines are interpreted; JSON is decoded per complete event, never per
chunk. Output is a pure function of the concatenated input: any split yields the same bytes.

Triton sends no `[DONE]` and no finish_reason or usage, so `close()` synthesises them: finish_reason
is `length` when the output token count reached max_tokens, else `stop`; usage comes from
`num_input_tokens`/`num_output_tokens` (requested via `return_num_*_tokens`) or, when absent, from
one token per event and ceil(prompt characters / 4). Streamed, TensorRT-LLM's `num_output_tokens`
counts the tokens of each response (event), not a running total (non-streaming responses carry the
total; NVIDIA/TensorRT-LLM pull request 5445), so the streamed counts are summed.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

_DONE = b"data: [DONE]\n\n"


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / 4)


def finish_reason(completion_tokens: int, max_tokens: int) -> str:
    return "length" if completion_tokens >= max_tokens else "stop"


def as_count(value: object) -> int | None:
    """Triton emits scalar tensors as scalars and one-element tensors sometimes as `[n]`."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value)


def as_text(value: object) -> str:
    if isinstance(value, list):
        value = value[0] if value else ""
    return value if isinstance(value, str) else ""


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error_event(message: str) -> bytes:
    return _event({"error": {"message": message, "type": "server_error", "param": None, "code": None}})


class TritonStreamTranslator:
    """One per request. `feed` returns the OpenAI SSE bytes that are ready; `close` the tail."""

    def __init__(
        self,
        *,
        chat: bool,
        model: str,
        request_id: str,
        created: int,
        max_tokens: int,
        prompt_tokens_estimate: int,
    ) -> None:
        self._chat = chat
        self._head: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        self._max_tokens = max_tokens
        self._prompt_estimate = prompt_tokens_estimate
        self._buf = bytearray()
        self._data: list[bytes] = []  # data lines of the event being read
        self._role_sent = False
        self._events = 0
        self._input_tokens: int | None = None
        self._output_tokens = 0  # the sum of the events' num_output_tokens (each counts its own tokens)
        self._counted = False  # whether any event carried num_output_tokens
        self._failed = False
        self._closed = False

    def feed(self, data: bytes) -> bytes:
        if self._closed:
            return b""
        self._buf += data
        out = bytearray()
        start = 0
        while (end := self._buf.find(b"\n", start)) >= 0:
            out += self._line(bytes(self._buf[start:end]).rstrip(b"\r"))
            start = end + 1
        del self._buf[:start]
        return bytes(out)

    def close(self) -> bytes:
        if self._closed:
            return b""
        out = bytearray()
        if self._buf:  # a last line without its newline: the body ended mid-event
            out += self._line(bytes(self._buf).rstrip(b"\r"))
            self._buf.clear()
        out += self._dispatch()
        self._closed = True
        if not self._failed:
            out += self._role()
            completion = self._completion_tokens()
            prompt = self._input_tokens if self._input_tokens is not None else self._prompt_estimate
            reason = finish_reason(completion, self._max_tokens)
            final = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
            if not self._chat:
                final = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
            out += _event({**self._head, "choices": [final]})
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            out += _event({**self._head, "choices": [], "usage": usage})
        out += _DONE
        return bytes(out)

    def _line(self, line: bytes) -> bytes:
        if not line:
            return self._dispatch()
        if line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(b" ") else value)
        return b""  # comments (":") and other SSE fields (event:, id:, retry:) carry nothing for us

    def _dispatch(self) -> bytes:
        if not self._data:
            return b""
        payload = b"\n".join(self._data)
        self._data = []
        if self._failed:
            return b""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            self._failed = True
            return error_event("Malformed event from backend")
        if "error" in obj:
            self._failed = True
            err = obj["error"]
            message = err if isinstance(err, str) else orjson.dumps(err).decode()
            return error_event(message or "Backend error")
        self._events += 1
        count = as_count(obj.get("num_output_tokens"))
        if count is not None:
            self._output_tokens += count
            self._counted = True
        inputs = as_count(obj.get("num_input_tokens"))
        if inputs is not None:
            self._input_tokens = inputs
        text = as_text(obj.get("text_output"))
        out = self._role()
        if text:
            choice = (
                {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
                if self._chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
            )
            out += _event({**self._head, "choices": [choice]})
        return out

    def _role(self) -> bytes:
        if self._role_sent or not self._chat:
            return b""
        self._role_sent = True
        delta = {"role": "assistant", "content": ""}
        return _event(
            {**self._head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
        )

    def _completion_tokens(self) -> int:
        """The per-event `num_output_tokens` summed; one per event when the backend sent none."""
        return self._output_tokens if self._counted else self._events
