"""Relays a Responses API stream (`event: <type>` + `data: <json>` events), measuring it on the way.

The same contract as `sse.SseRelay` (complete events forwarded as soon as their blank line arrives,
only a partial event held back, at most `MAX_EVENT_BYTES`), for the Responses event grammar:

- the time to first token is the first output delta (`response.output_text.delta`, and the deltas of
  function-call arguments, reasoning and refusals), the inter-token gaps are between deltas (k deltas
  in one read share the interval, as in `sse`);
- usage is read from the final response (`response.completed`, `response.incomplete` or
  `response.failed`), which ends the stream: there is no `[DONE]` (one is passed through if sent);
- the response id (for stored responses) from `response.created`;
- the backend's model name is rewritten to the client's in every event;
- an `error` event (or `response.failed`) is the stream's error.

Delta events are recognised by their `event:` line without parsing JSON; other events are parsed
(a few per stream). An event without an `event:` line is typed by its JSON `type`.
"""

from __future__ import annotations

from typing import Final

from backends.base import ErrorBody
from backends.openai_compat import parse_usage
from backends.responses_stream import error_event

from .. import json_codec
from ..observability.outcome import Gaps
from .sse import MAX_EVENT_BYTES, SseFramingError, StreamRelay, StreamStats, normalise_stream_error

_EVENT: Final = b"event:"
_DATA: Final = b"data:"
DELTAS: Final = frozenset({
    "response.output_text.delta", "response.function_call_arguments.delta", "response.refusal.delta",
    "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
})
FINAL: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesSseRelay(StreamRelay):
    def __init__(self, *, backend_model: str, client_model: str) -> None:
        self._buf = b""
        self._swap: tuple[bytes, bytes] | None = None
        if backend_model != client_model:
            self._swap = (b'"model":' + json_codec.dumps(backend_model), b'"model":' + json_codec.dumps(client_model))
        self._last_seq = -1
        self.response_id: str | None = None
        self.stats = StreamStats(Gaps())

    def feed(self, data: bytes, now: float) -> bytes:
        """The complete events of `buffered + data`, as the client gets them."""
        buf = (self._buf + data) if self._buf else data
        if 13 in buf:  # (an int: `bytes in bytes` formats a TypeError first, see sse.SseRelay.feed)
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._keep(buf)
            return b""
        self._keep(buf[end + 2:])
        out = buf[: end + 2]
        tokens = 0
        for block in out.split(b"\n\n"):
            if block:
                tokens += self._event(block)
        if tokens:
            self._tokens(tokens, now)
        swap = self._swap
        return out.replace(swap[0], swap[1]) if swap is not None else out

    def close(self, now: float) -> bytes:
        rest, self._buf = self._buf, b""
        return self.feed(rest + b"\n\n", now) if rest.strip() else b""

    def error_tail(self, error: ErrorBody) -> bytes:
        """The event that ends a stream the gateway has to cut (the SDK raises APIError on it)."""
        self._last_seq += 1
        return error_event(error, self._last_seq)

    # -- internals ------------------------------------------------------------------------------

    def _keep(self, rest: bytes) -> None:
        if len(rest) > MAX_EVENT_BYTES:
            raise SseFramingError(f"an SSE event longer than {MAX_EVENT_BYTES} bytes")
        self._buf = rest

    def _event(self, block: bytes) -> int:
        """Read one event; 1 when it carried output (a delta), else 0."""
        kind = None
        data = []
        for line in block.split(b"\n"):
            if line.startswith(_EVENT):
                kind = line[6:].strip().decode("utf-8", "replace")
            elif line.startswith(_DATA):
                data.append(line[5:].lstrip(b" "))
        if kind in DELTAS:
            self._last_seq += 1
            return 1
        if not data:
            return 0
        payload = b"\n".join(data)
        if payload.strip() == b"[DONE]":
            self.stats.done = True
            return 0
        try:
            obj = json_codec.loads(payload)
        except json_codec.JSONDecodeError:
            return 0
        if not isinstance(obj, dict):
            return 0
        seq = obj.get("sequence_number")
        if isinstance(seq, int):
            self._last_seq = seq
        kind = kind or (obj.get("type") if isinstance(obj.get("type"), str) else None)
        if kind in DELTAS:
            return 1
        if kind == "error" or ("error" in obj and kind is None):
            self.stats.error = normalise_stream_error(obj if "error" in obj else {"error": obj})
            return 0
        response = obj.get("response")
        if kind == "response.created" and isinstance(response, dict) and isinstance(response.get("id"), str):
            self.response_id = response["id"]
        if kind in FINAL:
            self.stats.done = True
            if isinstance(response, dict):
                usage = parse_usage(response)
                if usage is not None:
                    self.stats.usage = usage
                if kind == "response.failed":
                    failure = response.get("error")
                    self.stats.error = normalise_stream_error({"error": failure or "The response failed"})
        return 0
