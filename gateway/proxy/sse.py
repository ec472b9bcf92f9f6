"""Relays an OpenAI SSE stream event by event, measuring it on the way.

Every event is forwarded as soon as its terminating blank line arrives; nothing is held back except
a partial event. On the way we take TTFT and inter-token gaps, keep the usage chunk (which the
gateway always asks for) and drop it again if the client did not ask for it, rewrite the backend's
model name to the one the client used, and normalise error events to OpenAI's nested shape.

The hot path does byte searches only; JSON is parsed for the usage chunk and error events alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backends.base import ErrorBody, Usage
from backends.openai_compat import parse_usage

from .. import json_codec

DONE = b"data: [DONE]\n\n"
_DATA = b"data:"
_ERROR_PREFIX = b'data: {"error"'
_USAGE_KEY = b'"usage"'


def error_event(error: ErrorBody) -> bytes:
    return b"data: " + json_codec.dumps(error.as_dict()) + b"\n\n"


def normalise_stream_error(payload: Any) -> ErrorBody:
    """An error event from any runtime (nested, flat inside `error`, or a bare string)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        return ErrorBody(
            message=str(err.get("message") or "An error occurred during streaming"),
            type=str(err.get("type") or "server_error"),
            param=err.get("param") if isinstance(err.get("param"), str) else None,
            code=code if isinstance(code, str | int) else None,
        )
    return ErrorBody(message=str(err or "An error occurred during streaming"), type="server_error")


@dataclass(slots=True)
class StreamStats:
    """What the relay measured; times are clock readings (seconds)."""

    first_event_at: float | None = None
    last_event_at: float | None = None
    gaps: list[float] = field(default_factory=list)  # inter-token latencies
    events: int = 0  # data events that carried generation output
    usage: Usage | None = None
    error: ErrorBody | None = None
    done: bool = False


class SseRelay:
    def __init__(self, *, backend_model: str, client_model: str, include_usage: bool) -> None:
        self._buf = b""
        self._include_usage = include_usage
        self._swap: tuple[bytes, bytes] | None = None
        if backend_model != client_model:
            self._swap = (
                b'"model":' + json_codec.dumps(backend_model),
                b'"model":' + json_codec.dumps(client_model),
            )
        self.stats = StreamStats()

    def feed(self, data: bytes, now: float) -> bytes:
        buf = self._buf + data if self._buf else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2 :]
        out: list[bytes] = []
        for event in buf[: end + 2].split(b"\n\n"):
            if event:
                kept = self._event(event, now)
                if kept is not None:
                    out.append(kept)
                    out.append(b"\n\n")
        return b"".join(out)

    def _event(self, event: bytes, now: float) -> bytes | None:
        stats = self.stats
        if not event.startswith(_DATA):
            return event  # SSE comment or field we do not interpret: pass through
        if event.startswith(b"data: [DONE]"):
            stats.done = True
            return event
        if event.startswith(_ERROR_PREFIX):
            try:
                payload = json_codec.loads(event[5:])
            except json_codec.JSONDecodeError:
                payload = {"error": event[5:].decode("utf-8", "replace").strip()}
            stats.error = normalise_stream_error(payload)
            return error_event(stats.error)[:-2]
        if self._swap is not None:
            event = event.replace(self._swap[0], self._swap[1], 1)
        if _USAGE_KEY in event and self._usage_only(event):
            return event if self._include_usage else None
        if stats.first_event_at is None:
            stats.first_event_at = now
        else:
            stats.gaps.append(now - stats.last_event_at)  # type: ignore[operator]
        stats.last_event_at = now
        stats.events += 1
        return event

    def _usage_only(self, event: bytes) -> bool:
        """Record usage from a chunk; True when it is the usage-only chunk (no choices), which is
        not generation output and reaches the client only if the client asked for it."""
        try:
            payload = json_codec.loads(event[5:])
        except json_codec.JSONDecodeError:
            return False
        if not isinstance(payload, dict):
            return False
        usage = parse_usage(payload)
        if usage is not None:
            self.stats.usage = usage
        return not payload.get("choices")

    def close(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest
