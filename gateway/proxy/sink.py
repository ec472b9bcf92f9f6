"""What the HTTP fronts and the proxy agree on: where a response goes, and how a generation request
enters (or is refused before it could).

The proxy does not know which HTTP server carries the response: the native front
(`http.native_front.NativeSink`) on the hot path, or aiohttp (`http.aiohttp_sink.AiohttpSink`) for a
generation request on a connection aiohttp already owns. A response is either sent whole (`send`) or
streamed (`start` with the first bytes, `write`..., `end`); `start`, `write` and `push` raise
`ConnectionError` once the client has gone; a stream whose whole body is at hand (a short answer
that arrived in one read) is `send_stream`: head, body and end in one write. `push` is `write` for
a caller that cannot await (the relay's per-read callback, `client.UpstreamResponse.pipe`): it
writes now, or keeps the bytes, and says whether the caller must `await flush()` before pushing
more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from backends.base import Endpoint


class ResponseSink(Protocol):
    def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None: ...

    async def start(self, status: int, headers: Mapping[str, str], first: bytes = b"") -> None: ...

    async def send_stream(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """A streamed response (same head as `start`) whose whole body is `body`: `start`, `end`."""
        ...

    async def write(self, data: bytes) -> None: ...

    def push(self, data: bytes) -> bool:
        """Write `data` without waiting; True when `flush` must be awaited before the next push (the
        client reads slower than bytes arrive, or this sink only writes when awaited)."""
        ...

    async def flush(self) -> None: ...

    async def end(self) -> None: ...


class Entry(Protocol):
    """How a generation request reaches the gateway, from whichever front parsed it.

    Every generation request a front has identified (its request line names a generation endpoint) is
    reported exactly once: through `dispatch`, or, when the front refuses it before it is complete or
    readable (400, 408, 413, 431) or its client leaves before it could be dispatched, through
    `refused`. Either way it is counted once, in one place.
    """

    async def dispatch(
        self, headers: Mapping[str, str], body: bytes, endpoint: Endpoint, sink: ResponseSink, request_id: str
    ) -> None:
        """Serve the request; GatewayErrors raised mean nothing was sent: the front renders them."""
        ...

    def refused(self, endpoint: Endpoint, status: int | str, request_id: str | None) -> None:
        """The front answered `status` itself before the request could be dispatched (or, with
        "client_closed", the client went away before it could be)."""
        ...
