"""The baseline: a naive single-process aiohttp + uvloop reverse proxy (no parsing, routing, metrics).

`python -m bench.naive_proxy --upstream http://127.0.0.1:8001 [--port 0]`: forwards method, path
and body, and streams the upstream's response back chunk by chunk.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import uvloop
from aiohttp import web


async def serve(upstream: str, port: int) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout())

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with session.request(request.method, upstream + request.path_qs, data=body, headers=headers) as up:
            response = web.StreamResponse(status=up.status, headers={
                "Content-Type": up.headers.get("Content-Type", "application/octet-stream")})
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


def main(run: Callable[[str, int], Coroutine[Any, Any, None]] = serve, description: str | None = __doc__) -> None:
    """`--upstream URL [--port N]` for this proxy, or for another baseline's `run(upstream, port)`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    uvloop.run(run(args.upstream.rstrip("/"), args.port))


if __name__ == "__main__":
    main()
