"""The SSE relay's walk over a read's complete events (`sse.SseRelay.feed`), and where the C does it.

`relay_run` walks the complete events of `buf[pos:stop]` (a region that ends with a blank line) and
relays the events it can, up to the first one it leaves to the relay's general path (`sse.SseRelay`,
which parses it whole). It returns (where it stopped, the region as the client gets it or None when
unchanged, the events that carried output, whether `[DONE]` was passed, what it learned or None, the
last usage it read or None). The relay's per-stream state goes in: `prefix` and `suffix`, how this
stream's ordinary token events begin and end (learned from its first token event:
`sse.SseRelay._learn`), `client`, the prefix with the model renamed, `old` -> `new`, the renaming of
`"model":"<name>"` in every other event, and whether the client asked for the usage chunk.

Two implementations, one contract, and every event relayed the same whichever handles it:

* `reference_relay_run`, in Python, is what the pure build runs: it passes blank lines and ordinary
  token events (the prefix, then 1 to `max_text` bytes of text that do not start with a quote, then
  the suffix, which ends with the blank line) and leaves every other event to the general path.
* `_sse_scan.relay_run`, a small C extension built with the compiled modules (`make native`), also
  relays `[DONE]`, SSE comments and other fields, and chunks whose JSON it reads in one pass without
  building it (`facts_of` says what it reads): the role chunk, the finish chunk, the usage chunk, a
  first token event (learning the prefix from it as `_learn` does). It leaves to the general path
  errors, and what it is not sure of exactly as orjson would parse it.

Why C: a stream that reaches the gateway in one read (a short answer sent in one write) was walked
an event at a time, ~2k instructions an ordinary event compiled by mypyc (`bytes.find`'s argument
parsing and byte-by-byte search for a two-byte pattern, a slice per comparison) and an orjson parse
into dicts for each other event; the C walk is a memcmp, a memchr and a memcmp per ordinary event
and one pass over the bytes of each other event. `NATIVE` says which one runs (`gateway serve`
prints it); tests/unit/gateway/test_sse_scan.py holds the C to these references.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backends.openai_compat import parse_usage

from .. import json_codec

UsageRead = tuple[int, int, int | None]  # (prompt, completion, cached): `backends.base.Usage`'s fields
RunResult = tuple[int, bytes | None, int, bool, tuple[bytes, bytes, bytes | None] | None, UsageRead | None]
Walk = Callable[[bytes, int, int, bytes | None, bytes | None, bytes | None, bytes | None, bytes | None, int, bool],
                RunResult]
Facts = tuple[bool, UsageRead | None, bool, bool, int, bool]


def reference_relay_run(buf: bytes, pos: int, stop: int, prefix: bytes | None, suffix: bytes | None,
                        client: bytes | None, old: bytes | None, new: bytes | None, max_text: int,
                        include_usage: bool) -> RunResult:
    """`relay_run` for ordinary token events only (see the module's docstring)."""
    start, count = pos, 0
    while pos < stop and buf[pos] == 10:
        pos += 1
    if prefix is None or suffix is None:
        return pos, None, 0, False, None, None
    plen, slen = len(prefix), len(suffix)
    starts: list[int] = []
    while True:
        while pos < stop and buf[pos] == 10:
            pos += 1
        body = pos + plen
        if body >= stop or buf[body] == 34 or buf[pos:body] != prefix:
            break
        nxt = buf.find(b"\n\n", body, min(body + max_text + slen, stop))
        tail = nxt + 2 - slen  # where an ordinary event's suffix starts
        if nxt < 0 or not body < tail <= body + max_text or buf[tail:nxt + 2] != suffix:
            break
        if client is not None:
            starts.append(pos)
        count += 1
        pos = nxt + 2
    if client is None or not count:
        return pos, None, count, False, None, None
    parts: list[bytes] = []
    copied = start
    for at in starts:
        parts += (buf[copied:at], client)
        copied = at + plen
    parts.append(buf[copied:pos])
    return pos, b"".join(parts), count, False, None, None


def has_text(choice: object) -> bool:
    """Whether a streamed choice carries output (text, reasoning or a tool call)."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    or delta.get("tool_calls"))
    return bool(choice.get("text"))


def facts_of(payload: Any) -> Facts | None:
    """What the relay asks of a parsed event: (an error, its usage, `choices` is true, is a list, its
    length, one of its choices carries output), or None when it is not a JSON object."""
    if not isinstance(payload, dict):
        return None
    usage = parse_usage(payload)
    choices = payload.get("choices")
    is_list = isinstance(choices, list)
    return ("error" in payload or payload.get("object") == "error",
            (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) if usage is not None else None,
            bool(choices), is_list, len(choices) if isinstance(choices, list) else 0,
            isinstance(choices, list) and any(has_text(c) for c in choices))


def reference_facts(buf: bytes, start: int, end: int) -> Facts | None:
    """`event_facts`, by parsing: the facts of the JSON object buf[start:end], or None."""
    try:
        return facts_of(json_codec.loads(buf[start:end]))
    except json_codec.JSONDecodeError:
        return None


def reference_end(buf: bytes, pos: int, stop: int) -> int:
    """Where the first blank line at or after `pos` starts (both its LFs before `stop`), or -1."""
    return buf.find(b"\n\n", pos, stop)


try:
    from ._sse_scan import event_end as event_end
    from ._sse_scan import event_facts as event_facts
    from ._sse_scan import relay_run as relay_run

    NATIVE = True
except ImportError:  # the pure build (no `make native`)
    relay_run = reference_relay_run
    event_facts = reference_facts
    event_end = reference_end
    NATIVE = False
