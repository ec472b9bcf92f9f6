"""Relays an OpenAI SSE stream, measuring it on the way, at a few byte operations per read.

Every complete event is forwarded as soon as its terminating blank line arrives; only a partial event
is held back (at most `MAX_EVENT_BYTES`, else the stream is broken). On the way we take the time to
the first token and the inter-token gaps, keep the usage chunk (which the gateway always asks for)
and drop it again if the client did not ask for it, rewrite the backend's model name to the one the
client used, and normalise error events to OpenAI's nested shape.

Why it is cheap: a stream's ordinary token events all begin with the same bytes (id, object, created,
model, `"choices":[{"index":0,"delta":{"content":"`), so once the first token event has been parsed
that prefix is known, and a read holding one such event with non-empty text is recognised with three
byte comparisons, no JSON. A read holding many events (a whole short answer in one write) is walked
by `sse_scan.relay_run`: in the compiled build a C walk that passes ordinary events with a memcmp, a
memchr and a memcmp (the client's prefix in place of its own when the model is renamed) and reads
every other chunk's JSON in one pass without building it (role, finish and usage chunks, a first
token event it learns the prefix from); what it leaves (errors, anything it is not sure of reading
exactly as orjson would) takes the general path here, which parses the event (and renames the model
in it). The pure build's walk passes ordinary events only.

Framing follows the SSE standard: lines end with CRLF, LF or CR. A stream whose first line end holds a
CR is normalised to LF for its whole length (the runtimes we know send LF). `data:[DONE]` without the
space is accepted.

Timing is per token event, not per socket read: k tokens arriving in one read after an interval T
share it, k gaps of T / k, so engines that flush several tokens at once do not bias ITL low.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from backends.base import ErrorBody, Usage

from .. import json_codec
from ..observability.outcome import Gaps
from .sse_scan import Walk, event_end, facts_of, relay_run

# Final: the compiled build inlines them (a module global is a dict lookup at each use)
DONE: Final = b"data: [DONE]\n\n"
MAX_EVENT_BYTES: Final = 1024 * 1024  # a partial event larger than this is not an SSE stream we can relay
MAX_TOKEN_TEXT: Final = 64  # longest token text (as sent, escaped) the fast path takes; longer ones take the other
_DATA: Final = b"data:"
_TEXT_KEYS: Final = (b'"content":"', b'"text":"')  # where an ordinary chunk's generated text starts


class SseFramingError(Exception):
    """The upstream's stream cannot be relayed (an event beyond `MAX_EVENT_BYTES`)."""


def error_event(error: ErrorBody) -> bytes:
    return b"data: " + json_codec.dumps(error.as_dict()) + b"\n\n"


def normalise_stream_error(payload: Any) -> ErrorBody:
    """An error event from any runtime (nested, flat inside `error`, a bare string, or vLLM's
    `{"object": "error", "message": ...}`)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if err is None and isinstance(payload, dict) and payload.get("object") == "error":
        err = payload
    if isinstance(err, dict):
        code = err.get("code")
        return ErrorBody(
            message=str(err.get("message") or "An error occurred during streaming"),
            type=str(err.get("type") or "server_error"),
            param=err.get("param") if isinstance(err.get("param"), str) else None,
            code=code if isinstance(code, str | int) else None,
        )
    return ErrorBody(message=str(err or "An error occurred during streaming"), type="server_error")


_SWAPS: Final[dict[tuple[str, str], tuple[bytes, bytes]]] = {}  # model renamings, made once per pair


def _swap(backend_model: str, client_model: str) -> tuple[bytes, bytes]:
    """The bytes of `"model":"<backend's>"` and of what replaces it (`"model":"<client's>"`)."""
    key = (backend_model, client_model)
    swap = _SWAPS.get(key)
    if swap is None:
        if len(_SWAPS) >= 1024:  # model names come from the config (and a reload): this bounds a churn of them
            _SWAPS.clear()
        swap = _SWAPS[key] = (b'"model":' + json_codec.dumps(backend_model),
                              b'"model":' + json_codec.dumps(client_model))
    return swap


def _string_end(event: bytes, start: int) -> int:
    """Where the JSON string that starts at `start` (just past its opening quote) closes, or -1."""
    i = start
    while True:
        i = event.find(b'"', i)
        if i < 0:
            return -1
        backslashes = 0
        while event[i - 1 - backslashes] == 92:  # count the backslashes before this quote
            backslashes += 1
        if backslashes % 2 == 0:
            return i
        i += 1


@dataclass(slots=True)
class StreamStats:
    """What the relay measured; times are clock readings (seconds)."""

    gaps: Final[Gaps]
    first_token_at: float | None
    last_token_at: float | None
    tokens: int  # events that carried generated output: the completion estimate without usage
    usage: Usage | None
    error: ErrorBody | None
    done: bool

    def __init__(self, gaps: Gaps) -> None:
        self.gaps = gaps
        self.first_token_at = None
        self.last_token_at = None
        self.tokens = 0
        self.usage = None
        self.error = None
        self.done = False


class StreamRelay:
    """What the relay loop needs of an SSE relay: chat and completions chunks (`SseRelay`) or
    Responses events (`responses_sse.ResponsesSseRelay`). A common base, so the loop's per-read
    call is a native method call, not a call through a bound method of a union."""

    stats: StreamStats

    def feed(self, data: bytes, now: float) -> bytes:
        raise NotImplementedError

    def close(self, now: float) -> bytes:
        raise NotImplementedError

    def error_tail(self, error: ErrorBody) -> bytes:
        """What ends a stream that fails mid-way: an OpenAI error event and `[DONE]`."""
        return error_event(error) + DONE

    def _tokens(self, k: int, now: float) -> None:
        """`k` output tokens arrived at `now` (one read): TTFT at the first, gaps spread over the read's."""
        stats = self.stats
        last = stats.last_token_at
        if last is None:
            stats.first_token_at = now
            if k > 1:
                stats.gaps.add(0.0, k - 1)
        else:
            stats.gaps.add((now - last) / k, k)
        stats.last_token_at = now
        stats.tokens += k


class SseRelay(StreamRelay):
    def __init__(
        self, *, backend_model: str, client_model: str, include_usage: bool, run: Walk = relay_run
    ) -> None:
        """`run`: the walk over a read's complete events (`sse_scan`: the C one where it is built)."""
        self._run = run
        self._buf = b""
        self._cr: bool | None = None  # the stream uses CR line ends (decided on its first bytes)
        self._held_cr = False  # a CR ended the last read: it may be the first half of a CRLF
        self._include_usage = include_usage
        self._prefix: bytes | None = None  # how this stream's ordinary token events begin
        self._client_prefix: bytes | None = None  # the same, as the client gets it (model renamed)
        self._suffix = b""  # how they end, after the text (learned with the prefix)
        self._swap = _swap(backend_model, client_model) if backend_model != client_model else None
        self.stats = StreamStats(Gaps())

    def feed(self, data: bytes, now: float) -> bytes:
        """The complete events of `buffered + data`, as the client gets them."""
        if self._cr is None:  # decided by the first line end the stream sends
            # (an int, not b"\r": `bytes in bytes` first tries the argument as an int, and formats a
            # TypeError's message before it falls back to a search)
            if 13 in data:
                self._cr = True
            elif 10 in data:
                self._cr = False
        if self._cr:
            data = self._lf(data)
        prefix = self._prefix
        if prefix is not None and not self._buf:
            # The common read: one ordinary token event and nothing else, told by its learned prefix
            # and suffix and a text too short to hold another event (JSON escapes line ends, so an
            # event boundary can only come from a second event, and an ordinary event is longer than
            # MAX_TOKEN_TEXT). Compiled, `startswith` and `endswith` are a memcmp in place (no slice
            # is copied; other bytes methods are a method lookup and argument parsing).
            plen, n = len(prefix), len(data)
            suffix = self._suffix
            if (plen < n - len(suffix) <= plen + MAX_TOKEN_TEXT and data[plen] != 34 and data.startswith(prefix)
                    and data.endswith(suffix)):
                self._tokens(1, now)
                client = self._client_prefix
                return data if client is None else client + data[plen:]
        buf = self._buf + data if self._buf else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._keep(buf)
            return b""
        self._keep(buf[end + 2:])
        # Walk the complete events in place: `sse_scan.relay_run` relays what it can (runs of ordinary
        # token events, told by the learned prefix and suffix, get the client's prefix when the model is
        # renamed; the C walk also the chunks it can read without parsing them), and stops at an event
        # it leaves to the general path here, which parses it (usage, errors, anything unusual).
        parts: list[bytes] | None = None  # the output in pieces, once anything differs from the input
        copied = 0  # buf[:copied] is in `parts`
        tokens = 0
        pos = 0
        stop = end + 2
        swap = self._swap
        old, new = swap if swap is not None else (None, None)
        while pos < stop:
            run_end, piece, n, done, learned, usage = self._run(
                buf, pos, stop, prefix, self._suffix, self._client_prefix, old, new, MAX_TOKEN_TEXT,
                self._include_usage)
            tokens += n
            if done:
                self.stats.done = True
            if usage is not None:
                self.stats.usage = Usage(usage[0], usage[1], usage[2])
            if learned is not None:
                prefix, self._suffix, self._client_prefix = learned
                self._prefix = prefix
            if piece is not None:
                if parts is None:
                    parts = []
                parts.append(buf[copied:pos])
                parts.append(piece)
                copied = run_end
            pos = run_end
            if pos >= stop:
                break
            nxt = event_end(buf, pos, stop)
            event = buf[pos:nxt]
            kept, is_token = self._event(event)
            if is_token:
                tokens += 1
                prefix = self._prefix
            if swap is not None and kept is not None:
                kept = kept.replace(swap[0], swap[1])
            if kept is not event:
                if parts is None:
                    parts = []
                parts.append(buf[copied:pos])
                if kept is not None:
                    parts.append(kept + b"\n\n")
                copied = nxt + 2
            pos = nxt + 2
        if tokens:
            self._tokens(tokens, now)
        if parts is None:
            return buf[:stop] if stop < len(buf) else buf
        if copied == stop and len(parts) == 2 and not parts[0]:
            return parts[1]  # the walk relayed the whole read as one piece (the model renamed): no copy
        parts.append(buf[copied:stop])
        return b"".join(parts)

    def close(self, now: float) -> bytes:
        """The end of the upstream stream: a last event that lacked its blank line is still relayed."""
        rest, self._buf = self._buf, b""
        if self._held_cr:  # the stream ended on a CR: it was a line end
            self._held_cr = False
            rest += b"\n"
        if not rest.strip():
            return b""
        if not rest.endswith(b"\n\n"):
            rest += b"\n" if rest.endswith(b"\n") else b"\n\n"
        return self.feed(rest, now)

    # -- internals --------------------------------------------------------------------------------

    def _keep(self, rest: bytes) -> None:
        if len(rest) > MAX_EVENT_BYTES:
            raise SseFramingError(f"an SSE event longer than {MAX_EVENT_BYTES} bytes")
        self._buf = rest

    def _lf(self, data: bytes) -> bytes:
        """CRLF and CR line ends as LF; a trailing CR waits for the next read (it may start a CRLF)."""
        if self._held_cr:
            data = b"\r" + data
            self._held_cr = False
        if data.endswith(b"\r"):
            data = data[:-1]
            self._held_cr = True
        return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _event(self, event: bytes) -> tuple[bytes | None, bool]:
        """One event off the fast path: (what to forward, or None; whether it carried output)."""
        stats = self.stats
        if not event.startswith(_DATA):
            return event, False  # an SSE comment, or a field we do not interpret: pass it through
        body = event[5:].strip()
        if body == b"[DONE]":
            stats.done = True
            return DONE[:-2], False
        try:
            payload = json_codec.loads(body)
        except json_codec.JSONDecodeError:
            if body.startswith(b'{"error"'):
                stats.error = normalise_stream_error({"error": body.decode("utf-8", "replace")})
                return error_event(stats.error)[:-2], False
            return event, False
        facts = facts_of(payload)  # (what the C walk reads without parsing: `sse_scan`)
        if facts is None:
            return event, False
        error, usage, choices, _, n, output = facts
        if error:
            stats.error = normalise_stream_error(payload)
            return error_event(stats.error)[:-2], False
        if usage is not None:
            stats.usage = Usage(usage[0], usage[1], usage[2])
        if not choices:
            # the usage-only chunk is not output: it reaches the client only if the client asked
            return (event if self._include_usage or usage is None else None), False
        if output and self._prefix is None and n == 1:
            self._learn(event)
        return event, output

    def _learn(self, event: bytes) -> None:
        """Remember how this stream's ordinary token events begin: up to where the text starts. When
        the model is renamed, the fast path may only take events whose model name lies in the prefix."""
        for key in _TEXT_KEYS:
            at = event.find(key)
            if at > 0:
                start = at + len(key)
                end = _string_end(event, start)
                if end < 0:
                    return
                prefix, suffix = event[:start], event[end:] + b"\n\n"
                swap = self._swap
                if swap is not None:
                    if prefix.find(swap[0]) < 0 or suffix.find(swap[0]) >= 0:  # (`in`: see `feed`)
                        return  # no fast path for this stream: the general path renames every event
                    self._client_prefix = prefix.replace(swap[0], swap[1], 1)
                self._prefix, self._suffix = prefix, suffix
                return
