"""A lean HTTP/1.1 client for the request path: keep-alive connections pooled per origin.

Why not aiohttp's ClientSession: it spends ~100 µs of CPU per proxied request; the gateway only needs
"send these bytes, give me the status, headers and body as it arrives". See bench/upstream_micro.py.
Errors are one tree (`client.errors`); the proxy maps them once, at its edge.

Guarantees:
- `origin` is "http(s)://host[:port][/prefix]"; a path prefix is prepended to every `path`.
- `request()` resolves once the response head has arrived; the body follows through `read()`,
  `readany()` or `async for`. Interim 1xx responses are skipped.
- The request head carries the request line, `Host` (the caller's if given, else the origin's),
  `Content-Length` (always, except 0 on GET/DELETE/OPTIONS) and the caller's headers as given,
  less any `Content-Length`/`Transfer-Encoding` of theirs: we frame the body. HTTP/1.1 keep-alive.
- A connection goes back to its origin's idle stack (LIFO) as soon as the whole body has been
  received, if both sides allow keep-alive; the response keeps its buffered bytes. Idle connections
  that the peer closes, or that speak unasked, are dropped; ones idle longer than `idle_timeout_s`
  are closed when the pool is next used (no timers).
- Nothing is ever sent twice. A request on a reused connection that the server closes as we write
  fails with `UpstreamResetError` like any other; to make that race rare, idle connections expire
  after 4 s, before the 5 s keep-alive of uvicorn (which vLLM, SGLang and trtllm-serve serve with).
- `UpstreamResponse.close()` before the body's end, or cancelling `request()`/`read()`/`readany()`,
  aborts the connection (the upstream sees it close at once); it is never pooled.
- Flow control: past 256 KiB buffered and unread, reading from the socket pauses until it is read.
- Timeouts other than the TCP (and TLS) connect are the caller's.
- Not supported (ValueError): HEAD, whose response httptools cannot be told has no body; CR/LF in the
  path or a header. Also not: upgrades, trailers, streamed request bodies.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping, Sequence
from typing import Final

from .connection import Connection, Origin, request_head
from .errors import LOCAL_ERRNOS, UpstreamConnectError, UpstreamLocalExhaustion
from .response import UpstreamResponse

# uvicorn closes idle keep-alive connections after 5 s (`timeout_keep_alive`); expire ours before it.
IDLE_TIMEOUT_S: Final = 4.0


class UpstreamPool:
    """Keep-alive connections per origin; see the module docstring for what is guaranteed."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        max_idle_per_origin: int = 512,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """Create it inside the running loop. `ssl_context` is for https origins (default:
        `ssl.create_default_context()`). Host names are resolved on each new connection (no DNS cache)."""
        self.connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle_per_origin
        self._idle_timeout_s = idle_timeout_s
        self._ssl = ssl_context
        self._origins: dict[str, Origin] = {}
        self._closed = False
        self.loop = asyncio.get_running_loop()
        self.connections_opened = 0
        self.connections_lost = 0  # every opened connection is lost exactly once (asyncio's contract)

    @property
    def open_connections(self) -> int:
        return self.connections_opened - self.connections_lost

    def idle(self, origin: str) -> int:
        """How many idle connections to `origin` the pool holds."""
        found = self._origins.get(origin)
        return len(found.idle) if found is not None else 0

    @property
    def idle_total(self) -> int:
        return sum(len(o.idle) for o in self._origins.values())

    async def request(
        self,
        origin: str,
        method: str,
        path: str,
        headers: Sequence[tuple[str, str]] | Mapping[str, str],
        body: bytes = b"",
    ) -> UpstreamResponse:
        if self._closed:
            raise UpstreamConnectError("the upstream pool is closed")
        o = self._origins.get(origin) or self._add(origin)
        data = request_head(o, method, path, headers, len(body))
        if body:
            data += body
        conn = self._take(o) or await self._connect(o)
        resp = conn.send(data)
        try:
            await resp.head
        except BaseException:
            resp.close()
            raise
        return resp

    async def close(self) -> None:
        """Close the idle connections; later requests fail. Busy ones close when their response ends."""
        self._closed = True
        for o in self._origins.values():
            while o.idle:
                conn = o.idle.pop()
                conn.pooled = False
                conn.close()
        await asyncio.sleep(0)  # let the transports report their loss before the loop may close

    def _add(self, origin: str) -> Origin:
        tls = None
        if origin[:6].lower() == "https:":
            tls = self._ssl = self._ssl or ssl.create_default_context()
        o = self._origins[origin] = Origin(origin, tls)
        return o

    def _take(self, o: Origin) -> Connection | None:
        idle = o.idle
        while idle:
            conn = idle.pop()
            conn.pooled = False
            if self.loop.time() - conn.idle_since > self._idle_timeout_s:
                conn.close()  # the rest of the stack is older still
                continue
            return conn
        return None

    async def _connect(self, o: Origin) -> Connection:
        conn = Connection(self, o)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await self.loop.create_connection(
                    lambda: conn, o.host, o.port, ssl=o.tls, server_hostname=o.host if o.tls else None
                )
        except BaseException as exc:
            conn.close()  # cancelled just as the connection was made: do not leak it
            if isinstance(exc, OSError) and exc.errno in LOCAL_ERRNOS:
                raise UpstreamLocalExhaustion(f"cannot open a socket to {o.key}: {exc!r}") from exc
            if isinstance(exc, OSError | TimeoutError):
                raise UpstreamConnectError(f"cannot connect to {o.key}: {exc!r}") from exc
            raise
        self.connections_opened += 1
        return conn

    # -- called by connections ---------------------------------------------------------------------

    def release(self, conn: Connection) -> None:
        idle = conn.origin.idle
        if self._closed or len(idle) >= self._max_idle:
            conn.close()
            return
        now = conn.idle_since = self.loop.time()
        while idle and now - idle[0].idle_since > self._idle_timeout_s:
            old = idle.popleft()
            old.pooled = False
            old.close()
        conn.pooled = True
        idle.append(conn)

    def forget(self, conn: Connection) -> None:
        if conn.pooled:
            conn.pooled = False
            conn.origin.idle.remove(conn)
