"""The response sink for a generation request on a connection aiohttp owns."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web


class AiohttpSink:
    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None
        self._pending: list[bytes] = []

    def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.response = web.Response(status=status, body=body, headers=headers)

    async def start(self, status: int, headers: Mapping[str, str], first: bytes = b"") -> None:
        self.response = web.StreamResponse(status=status, headers=headers)
        await self.response.prepare(self._request)
        if first:
            await self.response.write(first)

    async def send_stream(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        await self.start(status, headers, body)
        await self.end()

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    def push(self, data: bytes) -> bool:
        self._pending.append(data)  # aiohttp writes only when awaited: `flush` sends it
        return True

    async def flush(self) -> None:
        assert self.response is not None
        pending, self._pending = self._pending, []
        await self.response.write(b"".join(pending))

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()
