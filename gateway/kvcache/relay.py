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
joins late, as a late subscriber does (replay, or a rebuild verified against usage). A relay that
cannot bind (an address still held by a process that is stopping) or stops on a bug is set up again
after a backoff (`gateway/retrying.py`); the workers see silence meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path

import aiohttp
import zmq
import zmq.asyncio

from ..retrying import Backoff, Sleep, forever
from ..settings import Backend
from ..tasks import cancel_all
from .intake import MAX_RETRY_S, RETRY_S, relay_endpoint, relayed
from .trtllm_source import TrtllmIntake
from .zmq_source import rank_endpoint

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
                 session: aiohttp.ClientSession, sleep: Sleep) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self.pub.bind(out)
        except zmq.ZMQError:
            self.close()
            raise
        loop = asyncio.get_running_loop()
        self.poll = TrtllmIntake(b.base_url, headers, self._publish, session, loop.time, sleep)

    def _publish(self, body: bytes) -> int:
        with contextlib.suppress(zmq.Again):  # (a PUB socket never blocks; at its HWM it drops)
            self.pub.send_multipart([b"trtllm", body], flags=zmq.NOBLOCK)
        empty = body.strip() in (b"", b"[]")
        return 0 if empty else 1  # (pacing only: the workers count and decode)

    async def run(self) -> None:
        await self.poll.run()

    def close(self) -> None:
        self.pub.close(linger=0)


class RelayDown(Exception):
    """A relay could not start, or stopped: set it up again after a backoff."""


class KvRelay:
    """The hub's relays, one per backend that needs one (`reconcile` per config)."""

    def __init__(self, directory: Path, session: aiohttp.ClientSession, *, sleep: Sleep = asyncio.sleep,
                 backoff: Backoff | None = None) -> None:
        self.directory = directory
        self._session = session
        self._sleep = sleep
        self._backoff = backoff if backoff is not None else Backoff(RETRY_S, MAX_RETRY_S)
        self._ctx: zmq.asyncio.Context | None = None
        self._running: dict[str, tuple[tuple[object, ...], asyncio.Task[None]]] = {}
        self._stopping: set[asyncio.Task[None]] = set()  # cancelled, not yet ended (their sockets open)

    def reconcile(self, backends: list[Backend], headers: Mapping[str, Mapping[str, str]]) -> None:
        """Relay exactly the backends that need it (must run inside the hub's loop). A relay that
        cannot bind is logged and retried; the workers see no events for that backend meanwhile
        (approximate index)."""
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
            task = asyncio.get_running_loop().create_task(self._keep(b, headers.get(name, {}), self._ctx),
                                                          name=f"kv-relay-{name}")
            self._running[name] = (self._spec(b), task)

    @staticmethod
    def _spec(b: Backend) -> tuple[object, ...]:
        return (b.runtime, b.base_url, b.kv_events)

    async def _keep(self, b: Backend, headers: Mapping[str, str], ctx: zmq.asyncio.Context) -> None:
        async for attempt in forever(wait=self._backoff, sleep=self._sleep, retry_on=RelayDown, log=log,
                                     what=f"backend {b.name}: relaying KV events to the workers"):
            with attempt:
                await self._run(b, headers, ctx)

    async def _run(self, b: Backend, headers: Mapping[str, str], ctx: zmq.asyncio.Context) -> None:
        out = relay_endpoint(self.directory, b.name)
        relay: _ZmqRelay | _TrtllmRelay
        try:
            if b.kv_events is not None and b.kv_events.endpoint is not None:
                relay = _ZmqRelay(b, ctx, out)
            else:
                relay = _TrtllmRelay(b, headers, ctx, out, self._session, self._sleep)
        except zmq.ZMQError as exc:
            raise RelayDown(f"cannot bind: {exc}; routing uses the approximate index") from exc
        try:
            await relay.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the workers notice the silence and fall back
            log.exception("backend %s: KV event relay stopped", b.name)
            raise RelayDown(f"stopped: {exc!r}") from exc
        finally:
            relay.close()
        raise RelayDown("stopped")  # (its loop has no end)

    def _stop(self, name: str) -> None:
        task = self._running.pop(name)[1]
        task.cancel()
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    @property
    def relaying(self) -> list[str]:
        return sorted(self._running)

    async def close(self) -> None:
        await cancel_all([*(t for _, t in self._running.values()), *self._stopping])
        self._running.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
