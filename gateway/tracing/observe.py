"""What a sampled request's response said, read from the bytes on their way to the client: the
finish reasons and the response id (`gen_ai.response.finish_reasons`, `gen_ai.response.id`).

Only sampled requests are watched (`Trace.observe` returns the sink itself otherwise), so the
relay's per-chunk path is untouched for the others. A whole body is parsed once; a stream's chunks
are searched for `"finish_reason":"..."` (every generation's last chunk carries one) and its first
`"id"`. `Sink` is what the proxy's response sinks provide (`proxy.sink.ResponseSink`, the same
methods: this room sits below the proxy and may not import it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final, Protocol

from .. import json_codec

_FINISH: Final = re.compile(rb'"finish_reason":\s*"([A-Za-z_]{1,32})"')
_ID: Final = re.compile(rb'"id":\s*"([^"\\]{1,128})"')


class Sink(Protocol):
    def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None: ...

    async def start(self, status: int, headers: Mapping[str, str], first: bytes = b"") -> None: ...

    async def send_stream(self, status: int, headers: Mapping[str, str], body: bytes) -> None: ...

    async def write(self, data: bytes) -> None: ...

    def push(self, data: bytes) -> bool: ...

    async def flush(self) -> None: ...

    async def end(self) -> None: ...


class Seen:
    """The finish reasons (in the order the choices ended) and the response id."""

    __slots__ = ("finish_reasons", "response_id")

    def __init__(self) -> None:
        self.finish_reasons: list[str] = []
        self.response_id: str | None = None

    def body(self, data: bytes) -> None:
        try:
            obj: Any = json_codec.loads(data)
        except json_codec.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        rid = obj.get("id")
        if isinstance(rid, str):
            self.response_id = rid
        choices = obj.get("choices")
        if isinstance(choices, list):
            ended = [(c["index"] if isinstance(c.get("index"), int) else i, c.get("finish_reason"))
                     for i, c in enumerate(choices) if isinstance(c, dict)]
            ended.sort(key=lambda e: e[0])
            self.finish_reasons = [r for _, r in ended if isinstance(r, str)]

    def chunk(self, data: bytes) -> None:
        if self.response_id is None:
            found = _ID.search(data)
            if found is not None:
                self.response_id = found.group(1).decode("utf-8", "replace")
        if b'"finish_reason"' in data:
            self.finish_reasons.extend(m.group(1).decode() for m in _FINISH.finditer(data))


class Observed:
    """A response sink that lets everything through and notes what `Seen` reads."""

    __slots__ = ("_sink", "seen")

    def __init__(self, sink: Sink, seen: Seen) -> None:
        self._sink = sink
        self.seen = seen

    def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.seen.body(body)
        self._sink.send(status, headers, body)

    async def start(self, status: int, headers: Mapping[str, str], first: bytes = b"") -> None:
        self.seen.chunk(first)
        await self._sink.start(status, headers, first)

    async def send_stream(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.seen.chunk(body)
        await self._sink.send_stream(status, headers, body)

    async def write(self, data: bytes) -> None:
        self.seen.chunk(data)
        await self._sink.write(data)

    def push(self, data: bytes) -> bool:
        self.seen.chunk(data)
        return self._sink.push(data)

    async def flush(self) -> None:
        await self._sink.flush()

    async def end(self) -> None:
        await self._sink.end()
