"""Where a proxied response goes: the interface the proxy writes to, and its aiohttp implementation.

The proxy does not know which HTTP server carries the response: the native front (`front.Reply`) on
the hot path, or aiohttp (`AiohttpReply`) for a generation request on a connection aiohttp already
owns. A response is either sent whole (`send`) or streamed (`start` with the first bytes, `write`...,
`end`); `start` and `write` raise `ConnectionError` once the client has gone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from aiohttp import web


class Reply(Protocol):
    def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None: ...

    async def start(self, status: int, headers: Mapping[str, str], first: bytes = b"") -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...


class AiohttpReply:
    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.response = web.Response(status=status, body=body, headers=headers)

    async def start(self, status: int, headers: Mapping[str, str], first: bytes = b"") -> None:
        self.response = web.StreamResponse(status=status, headers=headers)
        await self.response.prepare(self._request)
        if first:
            await self.response.write(first)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()
