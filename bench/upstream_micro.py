"""CPU per upstream request: aiohttp's ClientSession vs gateway.upstream.UpstreamPool, side by side.

The upstream is a tiny uvloop server in a child process (canned vLLM bodies from bench/upstream/);
only this process's CPU (time.process_time) is counted. Each client does what the proxy does per
request: POST a ~300-byte chat body, then read the whole JSON reply (`json`) or relay the SSE stream
chunk by chunk (`sse`: 66 events, chunked). Median of the repeats, clients interleaved per repeat.

    .venv/bin/python -m bench.upstream_micro [--requests 20000] [--repeats 5] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import uvloop

from bench.procs import PyServer
from bench.upstream import bodies
from gateway.client import UpstreamPool

BODY = b'{"model":"moe","messages":[{"role":"user","content":"' + b"hello " * 40 + b'"}],"max_tokens":16}'
HEADERS = {"content-type": "application/json", "x-request-id": "5f0c6a3e9b2d4c1f8a7e6d5c4b3a2910"}
Client = Callable[[str], Awaitable[None]]  # one request to a path, body read to its end


# -- the upstream (child process) ------------------------------------------------------------------

def _responses() -> dict[bytes, bytes]:
    chat = (bodies.HERE / "chat.json").read_bytes()
    stream = (bodies.HERE / "stream.sse").read_bytes()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in stream.split(b"\n\n")[:-1] for e in [e + b"\n\n"])
    return {
        b"/json": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            len(chat), chat),
        b"/sse": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + chunked + b"0\r\n\r\n",
    }


class _Upstream(asyncio.Protocol):
    """Answers each request (head, then Content-Length bytes of body) with a canned response by path."""

    RESPONSES = _responses()

    def __init__(self) -> None:
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end + 2].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15:head.find(b"\r\n", at)]) if at >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            path = head.split(b" ", 2)[1]
            self.transport.write(self.RESPONSES[path])  # type: ignore[attr-defined]


async def _serve() -> None:
    server = await asyncio.get_running_loop().create_server(_Upstream, "127.0.0.1", 0, backlog=1024)
    print(f"listening on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


# -- the clients ---------------------------------------------------------------------------------

def _aiohttp_client(session: aiohttp.ClientSession, origin: str) -> Client:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)  # as the proxy passes it

    async def one(path: str) -> None:
        resp = await session.post(origin + path, data=BODY, headers=HEADERS, timeout=timeout)
        try:
            async for _ in resp.content.iter_any():
                pass
        finally:
            resp.close()
    return one


def _upstream_client(pool: UpstreamPool, origin: str) -> Client:
    async def one(path: str) -> None:
        resp = await pool.request(origin, "POST", path, HEADERS, BODY)
        try:
            async for _ in resp:
                pass
        finally:
            resp.close()
    return one


async def _cpu_us_per_request(one: Client, path: str, requests: int, concurrency: int) -> float:
    async def worker(n: int) -> None:
        for _ in range(n):
            await one(path)

    await asyncio.gather(*(worker(50) for _ in range(concurrency)))  # warm up: connections, caches
    per_worker = requests // concurrency
    t0 = time.process_time()
    await asyncio.gather(*(worker(per_worker) for _ in range(concurrency)))
    return (time.process_time() - t0) / (per_worker * concurrency) * 1e6


async def _bench(origin: str, args: argparse.Namespace) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))  # as gateway/app.py
    pool = UpstreamPool()
    clients = {"aiohttp": _aiohttp_client(session, origin), "upstream": _upstream_client(pool, origin)}
    try:
        print(f"{args.requests} requests x {args.repeats} repeats, concurrency {args.concurrency}; "
              "client-process CPU µs per request (median)")
        for mode in args.modes:
            samples: dict[str, list[float]] = {name: [] for name in clients}
            for _ in range(args.repeats):
                for name, one in clients.items():
                    samples[name].append(await _cpu_us_per_request(one, f"/{mode}", args.requests, args.concurrency))
            a, u = (statistics.median(samples[n]) for n in ("aiohttp", "upstream"))
            spread = {n: f"{min(s):.1f}-{max(s):.1f}" for n, s in samples.items()}
            print(f"{mode:>5}: aiohttp {a:6.1f} µs ({spread['aiohttp']})   upstream {u:6.1f} µs "
                  f"({spread['upstream']})   ratio {a / u:.2f}x")
    finally:
        await session.close()
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--modes", nargs="+", choices=["json", "sse"], default=["json", "sse"])
    parser.add_argument("--serve", action="store_true", help="run the upstream server (the child process)")
    args = parser.parse_args()
    if args.serve:
        uvloop.run(_serve())
        return
    with tempfile.TemporaryDirectory() as tmp:
        server = PyServer("upstream", "bench.upstream_micro", ["--serve"], Path(tmp))
        try:
            uvloop.run(_bench(server.url, args))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
