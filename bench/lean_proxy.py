"""The gateway's own HTTP layers with nothing else: how much of its CPU is transport, how much logic.

`python -m bench.lean_proxy --upstream http://127.0.0.1:8001 [--port 0]`: the native front
(`gateway/front.py`) and the pooled upstream client (`gateway/upstream.py`) with no parsing, routing,
accounting or metrics: each generation request is forwarded as is and its answer relayed chunk by
chunk. The gateway's CPU per request minus this one is what its logic costs.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Mapping

from aiohttp import web

from backends.base import Endpoint
from bench import naive_proxy
from gateway.client import UpstreamPool
from gateway.http.native_front import Front
from gateway.proxy.sink import ResponseSink
from gateway.settings import Limits

PATHS = {Endpoint.CHAT: "/v1/chat/completions", Endpoint.COMPLETIONS: "/v1/completions"}


async def serve(upstream: str, port: int) -> None:
    pool = UpstreamPool()

    class Lean:
        @staticmethod
        def refused(endpoint: Endpoint, status: int | str, request_id: str | None) -> None:
            return None

        @staticmethod
        async def dispatch(
            headers: Mapping[str, str], body: bytes, endpoint: Endpoint, reply: ResponseSink, request_id: str
        ) -> None:
            await relay(body, endpoint, reply)

    async def relay(body: bytes, endpoint: Endpoint, reply: ResponseSink) -> None:
        resp = await pool.request(upstream, "POST", PATHS[endpoint], {"Content-Type": "application/json"}, body)
        try:
            kind = {"Content-Type": resp.headers.get("content-type", "application/json")}
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                await reply.start(resp.status, kind, await resp.readany())
                await resp.pipe(reply.push, reply.flush)  # as the gateway relays: from the read callback
                await reply.end()
            else:
                reply.send(resp.status, kind, await resp.read())
        finally:
            resp.close()

    runner = web.AppRunner(web.Application())  # nothing but generation requests arrive here
    await runner.setup()
    assert runner.server is not None
    front = Front(Lean(), runner.server, Limits())
    server = await asyncio.get_running_loop().create_server(front, "127.0.0.1", port, backlog=4096)
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 10)  # as the gateway does
    print(f"listening on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    naive_proxy.main(serve, __doc__)


if __name__ == "__main__":
    main()
