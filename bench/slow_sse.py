"""A slow vLLM-shaped SSE upstream: one token event per `--interval` seconds, `--events` of them,
then a usage chunk and [DONE]. nginx cannot drip a response, so the 10k-streams test uses this,
in its own process. Also answers GET /health (200, empty) and GET /metrics (minimal vLLM gauges).

`python -m bench.slow_sse [--port 0] [--events 30] [--interval 1]`
"""

from __future__ import annotations

import argparse
import asyncio

import orjson
import uvloop
from aiohttp import web

from bench.upstream.bodies import METRICS

HEAD = {"id": "chatcmpl-slow", "object": "chat.completion.chunk", "created": 1795974001, "model": "tiny-moe"}


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def serve(port: int, events: int, interval_s: float) -> None:
    token = _event({**HEAD, "choices": [{"index": 0, "delta": {"content": " tok"}, "logprobs": None,
                                         "finish_reason": None, "token_ids": None}]})
    tail = _event({**HEAD, "choices": [], "usage": {"prompt_tokens": 24, "total_tokens": 24 + events,
                                                    "completion_tokens": events}}) + b"data: [DONE]\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        for i in range(events):
            if i:
                await asyncio.sleep(interval_s)
            await response.write(token)
        await response.write(tail)
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b"")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=16384)
    await site.start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--events", type=int, default=30)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.events, args.interval))


if __name__ == "__main__":
    main()
