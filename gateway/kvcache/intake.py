"""Receiving the engines' KV events (I/O): one task per backend that publishes them.

* vLLM, SGLang: a ZMQ SUB socket subscribed to the backend's topic, bound or connected to its
  endpoint (one per data-parallel rank: port + rank). It is read from the moment it exists: a SUB
  socket only sends its subscription once it has processed the connection, so an idle one would
  make a connecting publisher drop its first batches. A sequence gap, or a first batch after
  sequence 0, asks the engine's replay ROUTER (when configured) for the missing batches: vLLM
  answers `[topic, seq, payload]` per batch, SGLang `[seq, payload]`, both end with seq -1.
* trtllm-serve: `POST /kv_cache_events` in a loop. The endpoint drains its queue (each event is
  returned once) and waits up to ~2 s for a first one, so the loop needs no timer of its own;
  a gateway polling it must be the only consumer.

Everything received goes into the backend's `BackendCache` (pure); a tick every second lets
caches notice silent publishers. `KvIntake.reconcile` starts, keeps or stops the tasks for a
config generation; the caches of kept backends carry on.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import zmq
import zmq.asyncio

from ..settings import Backend, KvEvents
from ..tasks import cancel_all
from .cache import BackendCache
from .events import Batch, KvDecodeError, decode_frames, decode_payload, decode_seq, decode_trtllm
from .registry import KvCaches

log = logging.getLogger(__name__)

END_SEQ = -1
REPLAY_TIMEOUT_S = 5.0
TICK_S = 1.0
POLL_TIMEOUT_S = 30.0  # one trtllm-serve poll (it answers within ~2 s when idle)
RETRY_S = 1.0  # after a failed poll
MIN_EMPTY_POLL_S = 0.1  # an empty answer faster than this (a server that does not wait) is paced


def relayed(b: Backend) -> bool:
    """Whether only one process may hear this backend's events: a bound endpoint (the engine
    connects to one address) or trtllm-serve's draining `/kv_cache_events`. Under `--workers N` the
    supervisor hears those and relays them to the workers (`relay`); a connecting subscriber can be
    one of many (a PUB socket sends every subscriber everything), so each worker connects itself."""
    kv = b.kv_events
    return kv is not None and (kv.bind or kv.endpoint is None)


def relay_endpoint(directory: Path, backend: str) -> str:
    """Where the supervisor republishes `backend`'s events: an ipc socket in its private directory
    (named by a digest: backend names may hold any character)."""
    digest = hashlib.blake2b(backend.encode(), digest_size=8).hexdigest()
    return f"ipc://{directory}/kv-{digest}"


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel `rank`: the port plus the rank (vLLM's `offset_endpoint_port`),
    or `_dp<rank>` appended to ipc/inproc names."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port) != 0:
            return f"{head}:{int(port) + rank}"
        return endpoint
    return f"{endpoint}_dp{rank}"


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start_seq: int, *,
                 timeout_s: float = REPLAY_TIMEOUT_S) -> list[Batch]:
    """Every batch the publisher still buffers from `start_seq` on (raises TimeoutError)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    out: list[Batch] = []
    try:
        await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        async with asyncio.timeout(timeout_s):
            while True:
                frames = await dealer.recv_multipart()
                if len(frames) == 4:  # vLLM: ["", topic, seq, payload]
                    seq_frame, payload = frames[2], frames[3]
                elif len(frames) == 3:  # SGLang: ["", seq, payload]
                    seq_frame, payload = frames[1], frames[2]
                else:
                    raise KvDecodeError(f"replay answer of {len(frames)} frames")
                seq = decode_seq(seq_frame)
                if seq == END_SEQ:
                    return out
                out.append(decode_payload(seq, payload))
    finally:
        dealer.close(linger=0)


class ZmqIntake:
    """One vLLM/SGLang backend's SUB socket and its receive loop."""

    def __init__(self, cfg: KvEvents, cache: BackendCache, ctx: zmq.asyncio.Context,
                 clock: Callable[[], float], *, relayed: str | None = None) -> None:
        """With `relayed`, connect to that endpoint (the supervisor's relay of every rank's
        messages, `kvcache.relay`) instead of the engine's."""
        assert cfg.endpoint is not None
        self.cfg = cfg
        self.cache = cache
        self._ctx = ctx
        self._clock = clock
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
        if relayed is not None:
            self.endpoints = [relayed]
        else:
            self.endpoints = [rank_endpoint(cfg.endpoint, r) for r in range(cfg.data_parallel_size)]
        try:
            for ep in self.endpoints:
                if cfg.bind and relayed is None:
                    self.sock.bind(ep)
                else:
                    self.sock.connect(ep)
        except zmq.ZMQError:
            self.sock.close(linger=0)  # an open socket would block the context's termination
            raise

    async def run(self) -> None:
        cache = self.cache
        while True:
            frames = await self.sock.recv_multipart()
            try:
                batch = decode_frames(frames)
            except KvDecodeError as exc:
                cache.stats.decode_errors += 1
                log.debug("backend %s: undecodable KV event message: %s", cache.name, exc)
                continue
            missing = cache.receive(batch, self._clock())
            if missing is not None:
                await self._resolve(batch.rank, missing)

    async def _resolve(self, rank: int, first_missing: int) -> None:
        cache = self.cache
        why = "gap" if first_missing > 0 else "joined late"
        if self.cfg.replay_endpoint is None:
            cache.lose(rank, why, self._clock())
            return
        try:
            batches = await replay(self._ctx, rank_endpoint(self.cfg.replay_endpoint, rank), first_missing)
        except (TimeoutError, KvDecodeError, zmq.ZMQError) as exc:
            log.info("backend %s: KV event replay from seq %d failed (%s)", cache.name, first_missing, exc)
            cache.lose(rank, why, self._clock())
            return
        if not cache.fill(rank, [b for b in batches if b.rank == rank or self.cfg.data_parallel_size == 1],
                          self._clock()):
            log.info("backend %s: replay could not fill the KV event gap from seq %d", cache.name, first_missing)

    def close(self) -> None:
        self.sock.close(linger=0)


def trtllm_receiver(cache: BackendCache, clock: Callable[[], float]) -> Callable[[bytes], int]:
    """What a `/kv_cache_events` answer does to a backend's cache; how many events it held."""

    def receive(body: bytes) -> int:
        try:
            items = decode_trtllm(orjson.loads(body))
        except (KvDecodeError, orjson.JSONDecodeError) as exc:
            cache.stats.decode_errors += 1
            log.debug("backend %s: undecodable /kv_cache_events answer: %s", cache.name, exc)
            return -1
        cache.receive_trtllm(items, clock())
        return len(items)

    return receive


class TrtllmIntake:
    """One trtllm-serve backend's `/kv_cache_events` poll loop; each answer goes to `deliver`
    (`trtllm_receiver`, or the supervisor's relay), which says how many events it held (-1: none
    readable)."""

    def __init__(self, url: str, headers: Mapping[str, str], deliver: Callable[[bytes], int],
                 session: aiohttp.ClientSession, clock: Callable[[], float],
                 sleep: Callable[[float], Awaitable[None]]) -> None:
        self.url = url.rstrip("/") + "/kv_cache_events"
        self.headers = dict(headers)
        self.deliver = deliver
        self._session = session
        self._clock = clock
        self._sleep = sleep

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)
        while True:
            started = self._clock()
            try:
                async with self._session.post(self.url, headers=self.headers, timeout=timeout) as resp:
                    body = await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError):
                await self._sleep(RETRY_S)
                continue
            if status != 200:
                await self._sleep(RETRY_S)
                continue
            held = self.deliver(body)
            if held < 0:
                await self._sleep(RETRY_S)
            elif held == 0 and self._clock() - started < MIN_EMPTY_POLL_S:
                await self._sleep(MIN_EMPTY_POLL_S)

    def close(self) -> None:
        return None


class RelayedTrtllmIntake:
    """A worker's share of a trtllm-serve backend's events: the supervisor polls (the endpoint
    drains its queue: one poller only) and republishes each answer; this subscribes to them."""

    def __init__(self, endpoint: str, cache: BackendCache, ctx: zmq.asyncio.Context,
                 clock: Callable[[], float]) -> None:
        self.receive = trtllm_receiver(cache, clock)
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            self.sock.connect(endpoint)
        except zmq.ZMQError:
            self.sock.close(linger=0)
            raise

    async def run(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            self.receive(frames[-1])

    def close(self) -> None:
        self.sock.close(linger=0)


Intake = ZmqIntake | TrtllmIntake | RelayedTrtllmIntake


def backend_headers(keys: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """Each backend's credentials as the headers of its HTTP requests (`Secrets.backend_keys`)."""
    return {name: {"Authorization": f"Bearer {key.get_secret_value()}"} for name, key in keys.items()}


def _closer(intake: Intake) -> Callable[[asyncio.Task[None]], None]:
    def close(_: asyncio.Task[None]) -> None:
        intake.close()

    return close


@dataclass
class _Running:
    spec: tuple[object, ...]  # what the task was started from: restarted when it changes
    intake: Intake
    task: asyncio.Task[None]


class KvIntake:
    """The intake tasks of the current config, over the process's `KvCaches`."""

    def __init__(self, caches: KvCaches, session: aiohttp.ClientSession, *,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, relay_dir: Path | None = None) -> None:
        """With `relay_dir` (a worker under `--workers N`: its supervisor's private directory), the
        backends only one process may hear (`relay.relayed`) are heard through the supervisor."""
        self.caches = caches
        self.relay_dir = relay_dir
        self._session = session
        self._sleep = sleep
        self._ctx: zmq.asyncio.Context | None = None
        self._running: dict[str, _Running] = {}
        self._ticker: asyncio.Task[None] | None = None

    def reconcile(self, backends: list[Backend], headers: Mapping[str, Mapping[str, str]]) -> None:
        """Run one intake per backend with `kv_events` (must run inside the serving loop).
        `headers[name]` are the extra headers of a backend's HTTP requests (its credentials)."""
        wanted = {b.name: b for b in backends if b.kv_events is not None}
        for name in list(self._running):
            b = wanted.get(name)
            if b is None or self._spec(b) != self._running[name].spec:
                self._stop(name)
                self.caches.drop(name)  # another engine, or another way to hear it: start over
        for name, b in wanted.items():
            if name in self._running:
                continue
            cache = self.caches.add(name)
            assert b.kv_events is not None
            cache.silent_after_s = b.kv_events.silent_after_s
            try:
                intake = self._intake(b, cache, headers.get(name, {}))
            except zmq.ZMQError as exc:
                log.error("backend %s: cannot %s KV events endpoint %s: %s (routing uses the approximate index)",
                          name, "bind" if b.kv_events.bind else "connect", b.kv_events.endpoint, exc)
                continue
            task = asyncio.get_running_loop().create_task(self._guard(name, intake), name=f"kv-events-{name}")
            task.add_done_callback(_closer(intake))  # the socket closes once its reader is gone
            self._running[name] = _Running(self._spec(b), intake, task)
        self.caches.retain(wanted)
        if self._ticker is None and self._running:
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="kv-events-tick")

    @staticmethod
    def _spec(b: Backend) -> tuple[object, ...]:
        return (b.runtime, b.base_url, b.kv_events)

    def _intake(self, b: Backend, cache: BackendCache, headers: Mapping[str, str]) -> Intake:
        assert b.kv_events is not None
        via = relay_endpoint(self.relay_dir, b.name) if self.relay_dir is not None and relayed(b) else None
        if b.kv_events.endpoint is None and via is None:  # trtllm-serve (settings enforce it)
            return TrtllmIntake(b.base_url, headers, trtllm_receiver(cache, self.caches.clock), self._session,
                                self.caches.clock, self._sleep)
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        if b.kv_events.endpoint is None:
            assert via is not None
            return RelayedTrtllmIntake(via, cache, self._ctx, self.caches.clock)
        return ZmqIntake(b.kv_events, cache, self._ctx, self.caches.clock, relayed=via)

    async def _guard(self, name: str, intake: Intake) -> None:
        try:
            await intake.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in the intake must not take the gateway down; routing falls back
            log.exception("backend %s: KV event intake stopped", name)
            cache = self.caches.get(name)
            if cache is not None:
                cache.lose(0, "intake failed", self.caches.clock())

    async def _tick(self) -> None:
        while True:
            await self._sleep(TICK_S)
            self.caches.tick()

    def _stop(self, name: str) -> None:
        self._running.pop(name).task.cancel()

    async def close(self) -> None:
        tasks = [r.task for r in self._running.values()]
        if self._ticker is not None:
            tasks.append(self._ticker)
        await cancel_all(tasks)
        self._running.clear()
        self._ticker = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
