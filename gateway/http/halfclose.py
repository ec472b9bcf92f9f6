"""Telling a half-closed client from one that has gone, while its request runs.

A client's FIN says "I have nothing more to send". It may be a half-close (`shutdown(SHUT_WR)`: it
still reads the response, and gets it) or a close (the client has gone: its request should be
cancelled, which aborts the upstream generation). TCP shows no difference until the server sends
something: a closed socket answers any data with RST. So both fronts keep the connection after the
FIN and, while a request still runs, watch it: if the response has not started and the request is
HTTP/1.1, they send `100 Continue` (a client must accept and skip an unasked 1xx, RFC 9110 15.2; an
HTTP/1.0 client gets none); if an event stream has started (the native front), an SSE comment (`:`:
the WHATWG event-stream format says a line that starts with a colon is ignored), so that a stream
the engine is still silent on (a long prefill, a queue) learns its client has gone now rather than
at its next token; and every `interval_s` they read the socket's pending error (`SO_ERROR`). An RST,
provoked by that probe or by the response's own writes, shows there, and `gone()` is called.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"  # before a response has started (HTTP/1.1)
STREAM_PROBE = b":\n\n"  # between the events of a started event stream (framed as the stream is)


class GoneWatch:
    """Calls `gone()` once the client of a half-closed connection turns out to have closed it."""

    __slots__ = ("_gone", "_handle", "_interval_s", "_loop", "_sock")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, gone: Callable[[], None], *,
        probe: bytes, interval_s: float = 0.2,
    ) -> None:
        """`probe`: what to write now, to provoke an RST from a client that has gone (b"": nothing)."""
        self._loop = loop
        self._gone = gone
        self._interval_s = interval_s
        self._sock = transport.get_extra_info("socket")
        if probe:
            transport.write(probe)
        self._handle: asyncio.TimerHandle | None = loop.call_later(interval_s, self._check)

    def _check(self) -> None:
        self._handle = None
        try:
            error = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if self._sock is not None else 0
        except OSError:
            error = 1
        if error:
            self._gone()
        else:
            self._handle = self._loop.call_later(self._interval_s, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
