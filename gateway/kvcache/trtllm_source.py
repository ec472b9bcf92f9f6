"""Hearing a trtllm-serve engine's KV events (I/O): `POST /kv_cache_events` in a loop.

The endpoint drains its queue (each event is returned once) and waits up to ~2 s for a first one,
so the loop needs no timer of its own; a gateway polling it must be the only consumer (under
`--workers N` the supervisor polls and republishes each answer: `RelayedTrtllmIntake` is a
worker's end of that). A poll that fails (the engine unreachable or erroring, an answer that is no
list of events) is retried with backoff (`gateway/retrying.py`), and the backoff starts again with
the next answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import aiohttp
import orjson
import zmq
import zmq.asyncio

from ..retrying import Backoff, Sleep, forever
from .cache import BackendCache
from .events import KvDecodeError, decode_trtllm

log = logging.getLogger(__name__)

POLL_TIMEOUT_S = 30.0  # one trtllm-serve poll (it answers within ~2 s when idle)
RETRY_S = 1.0  # the first pause after a failed poll ...
MAX_RETRY_S = 30.0  # ... doubling up to this
MIN_EMPTY_POLL_S = 0.1  # an empty answer faster than this (a server that does not wait) is paced


class PollFailed(Exception):
    """A `/kv_cache_events` poll that brought no events to read."""


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
                 session: aiohttp.ClientSession, clock: Callable[[], float], sleep: Sleep, *,
                 backoff: Backoff | None = None) -> None:
        self.url = url.rstrip("/") + "/kv_cache_events"
        self.headers = dict(headers)
        self.deliver = deliver
        self._session = session
        self._clock = clock
        self._sleep = sleep
        self._backoff = backoff if backoff is not None else Backoff(RETRY_S, MAX_RETRY_S)

    async def run(self) -> None:
        while True:
            started = self._clock()
            held = 0
            async for attempt in forever(wait=self._backoff, sleep=self._sleep, retry_on=PollFailed, log=log,
                                         what=f"polling {self.url}"):
                with attempt:
                    started = self._clock()
                    held = await self.poll()
            if held == 0 and self._clock() - started < MIN_EMPTY_POLL_S:
                await self._sleep(MIN_EMPTY_POLL_S)

    async def poll(self) -> int:
        """One poll: how many events the answer held (raises PollFailed)."""
        timeout = aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)
        try:
            async with self._session.post(self.url, headers=self.headers, timeout=timeout) as resp:
                body = await resp.read()
                status = resp.status
        except TimeoutError as exc:
            raise PollFailed("no answer in time") from exc
        except aiohttp.ClientError as exc:
            raise PollFailed(f"{type(exc).__name__}: {exc}") from exc
        if status != 200:
            raise PollFailed(f"HTTP {status}")
        held = self.deliver(body)
        if held < 0:
            raise PollFailed("an answer that is not a list of KV events")
        return held

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
