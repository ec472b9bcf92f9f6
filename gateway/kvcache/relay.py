"""The supervisor's side of KV events under `gateway serve --workers N` (I/O).

Each worker keeps its own `KvCaches` (routing consults them on the request path, in process). A
worker whose backend's engine binds its publisher connects a SUB socket of its own, like any
number of gateway replicas. Two intakes can only happen once per host (`intake.relayed`): a bound
endpoint (`kv_events.bind`: the engine connects to one address, only one process can bind it) and
trtllm-serve's `/kv_cache_events` (each poll drains the queue: two pollers would split the events
between them). For those the hub receives once and republishes every message unchanged on a PUB
socket in its private 0700 directory (`intake.relay_endpoint`); each worker subscribes there as if
to the engine, so its cache sees the engine's own sequence numbers and event ids, and gaps,
restarts and silence are judged by the same code. A worker that (re)starts while events flow
joins late, as a late subscriber does (replay, or a rebuild verified against usage).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp
import zmq
import zmq.asyncio

from ..settings import Backend
from ..tasks import cancel_all
from .intake import TrtllmIntake, rank_endpoint, relay_endpoint, relayed

log = logging.getLogger(__name__)


class _ZmqRelay:
    """A bound endpoint (every data-parallel rank's) forwarded to one PUB socket."""

    def __init__(self, b: Backend, ctx: zmq.asyncio.Context, out: str) -> None:
        kv = b.kv_events
        assert kv is not None
        assert kv.endpoint is not None
        self.sub = ctx.socket(zmq.SUB)
        self.pub = ctx.socket(zmq.PUB)
        for sock in (self.sub, self.pub):
            sock.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, kv.topic.encode())
        try:
            self.pub.bind(out)
            for rank in range(kv.data_parallel_size):
                self.sub.bind(rank_endpoint(kv.endpoint, rank))
        except zmq.ZMQError:
            self.close()
            raise

    async def run(self) -> None:
        while True:
            await self.pub.send_multipart(await self.sub.recv_multipart(copy=True))

    def close(self) -> None:
        self.sub.close(linger=0)
        self.pub.close(linger=0)


class _TrtllmRelay:
    """trtllm-serve's `/kv_cache_events`, polled once, each answer published whole."""

    def __init__(self, b: Backend, headers: Mapping[str, str], ctx: zmq.asyncio.Context, out: str,
                 session: aiohttp.ClientSession) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self.pub.bind(out)
        except zmq.ZMQError:
            self.close()
            raise
        loop = asyncio.get_running_loop()
        self.poll = TrtllmIntake(b.base_url, headers, self._publish, session, loop.time, asyncio.sleep)

    def _publish(self, body: bytes) -> int:
        with contextlib.suppress(zmq.Again):  # (a PUB socket never blocks; at its HWM it drops)
            self.pub.send_multipart([b"trtllm", body], flags=zmq.NOBLOCK)
        empty = body.strip() in (b"", b"[]")
        return 0 if empty else 1  # (pacing only: the workers count and decode)

    async def run(self) -> None:
        await self.poll.run()

    def close(self) -> None:
        self.pub.close(linger=0)


def _closer(relay: _ZmqRelay | _TrtllmRelay) -> Callable[[asyncio.Task[None]], None]:
    def close(_: asyncio.Task[None]) -> None:
        relay.close()

    return close


class KvRelay:
    """The hub's relays, one per backend that needs one (`reconcile` per config)."""

    def __init__(self, directory: Path, session: aiohttp.ClientSession) -> None:
        self.directory = directory
        self._session = session
        self._ctx: zmq.asyncio.Context | None = None
        self._running: dict[str, tuple[tuple[object, ...], _ZmqRelay | _TrtllmRelay, asyncio.Task[None]]] = {}

    def reconcile(self, backends: list[Backend], headers: Mapping[str, Mapping[str, str]]) -> None:
        """Relay exactly the backends that need it (must run inside the hub's loop). A relay that
        cannot bind is logged; the workers then see no events for that backend (approximate index)."""
        wanted = {b.name: b for b in backends if relayed(b)}
        for name in list(self._running):
            b = wanted.get(name)
            if b is None or self._spec(b) != self._running[name][0]:
                self._stop(name)
        for name, b in wanted.items():
            if name in self._running:
                continue
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            out = relay_endpoint(self.directory, name)
            relay: _ZmqRelay | _TrtllmRelay
            try:
                if b.kv_events is not None and b.kv_events.endpoint is not None:
                    relay = _ZmqRelay(b, self._ctx, out)
                else:
                    relay = _TrtllmRelay(b, headers.get(name, {}), self._ctx, out, self._session)
            except zmq.ZMQError as exc:
                log.error("backend %s: cannot relay KV events to the workers: %s (routing uses the approximate "
                          "index)", name, exc)
                continue
            task = asyncio.get_running_loop().create_task(self._guard(name, relay), name=f"kv-relay-{name}")
            task.add_done_callback(_closer(relay))  # (also when cancelled before it started)
            self._running[name] = (self._spec(b), relay, task)

    @staticmethod
    def _spec(b: Backend) -> tuple[object, ...]:
        return (b.runtime, b.base_url, b.kv_events)

    async def _guard(self, name: str, relay: _ZmqRelay | _TrtllmRelay) -> None:
        try:
            await relay.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # the workers notice the silence and fall back
            log.exception("backend %s: KV event relay stopped", name)

    def _stop(self, name: str) -> None:
        self._running.pop(name)[2].cancel()

    @property
    def relaying(self) -> list[str]:
        return sorted(self._running)

    async def close(self) -> None:
        await cancel_all(t for _, _, t in self._running.values())
        self._running.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
