"""Receiving the engines' KV events (I/O): one task per backend that publishes them.

* vLLM, SGLang: a ZMQ SUB socket on the engine's publisher, and its replay socket
  (`zmq_source.ZmqIntake`);
* trtllm-serve: `POST /kv_cache_events` in a loop (`trtllm_source.TrtllmIntake`).

Everything received goes into the backend's `BackendCache` (pure); a tick every second lets
caches notice silent publishers, and a source that just went silent is logged once with what
probably causes it and the fix (`silence.explain`; also its `/admin/backends` hint).
`KvIntake.reconcile` starts, keeps or stops the tasks for a config generation; the caches of kept
backends carry on. A task whose socket cannot be bound or connected (an address still held by a
process that is stopping, the supervisor's relay not up yet), or whose intake stops on a bug, sets
it up again after a backoff (`gateway/retrying.py`); routing uses the approximate index meanwhile.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import zmq
import zmq.asyncio

from ..retrying import Backoff, Sleep, forever
from ..settings import Backend
from ..tasks import cancel_all
from .cache import BackendCache
from .registry import KvCaches
from .silence import explain
from .trtllm_source import RelayedTrtllmIntake, TrtllmIntake, trtllm_receiver
from .zmq_source import ZmqIntake, rank_endpoint

log = logging.getLogger(__name__)

TICK_S = 1.0
RETRY_S = 1.0  # the first pause before an intake that could not start (or stopped) is set up again ...
MAX_RETRY_S = 30.0  # ... doubling up to this

__all__ = ["KvIntake", "TrtllmIntake", "backend_headers", "rank_endpoint", "relay_endpoint", "relayed"]


class IntakeDown(Exception):
    """A backend's intake could not start, or stopped: set it up again after a backoff."""


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


Intake = ZmqIntake | TrtllmIntake | RelayedTrtllmIntake


def backend_headers(keys: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """Each backend's credentials as the headers of its HTTP requests (`Secrets.backend_keys`)."""
    return {name: {"Authorization": f"Bearer {key.get_secret_value()}"} for name, key in keys.items()}


@dataclass
class _Running:
    spec: tuple[object, ...]  # what the task was started from: restarted when it changes
    backend: Backend
    task: asyncio.Task[None] | None = None
    failed: str | None = None  # why its socket cannot be set up (while it cannot)


class KvIntake:
    """The intake tasks of the current config, over the process's `KvCaches`."""

    def __init__(self, caches: KvCaches, session: aiohttp.ClientSession, *, sleep: Sleep = asyncio.sleep,
                 relay_dir: Path | None = None, backoff: Backoff | None = None) -> None:
        """With `relay_dir` (a worker under `--workers N`: its supervisor's private directory), the
        backends only one process may hear (`relay.relayed`) are heard through the supervisor.
        `backoff` paces the set-up of an intake that could not start or stopped."""
        self.caches = caches
        self.relay_dir = relay_dir
        self._session = session
        self._sleep = sleep
        self._backoff = backoff if backoff is not None else Backoff(RETRY_S, MAX_RETRY_S)
        self._ctx: zmq.asyncio.Context | None = None
        self._running: dict[str, _Running] = {}
        self._stopping: set[asyncio.Task[None]] = set()  # cancelled, not yet ended (their sockets open)
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
        loop = asyncio.get_running_loop()
        for name, b in wanted.items():
            if name in self._running:
                self._running[name].backend = b
                continue
            cache = self.caches.add(name)
            assert b.kv_events is not None
            cache.silent_after_s = b.kv_events.silent_after_s
            running = self._running[name] = _Running(self._spec(b), b)
            running.task = loop.create_task(self._keep(running, cache, headers.get(name, {})),
                                            name=f"kv-events-{name}")
        self.caches.retain(wanted)
        if self._ticker is None and self._running:
            self._ticker = loop.create_task(self._tick(), name="kv-events-tick")

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

    async def _keep(self, running: _Running, cache: BackendCache, headers: Mapping[str, str]) -> None:
        """Run the backend's intake until cancelled, set up again after a backoff whenever it
        cannot start or stops."""
        async for attempt in forever(wait=self._backoff, sleep=self._sleep, retry_on=IntakeDown, log=log,
                                     what=f"backend {running.backend.name}: the KV event intake"):
            with attempt:
                await self._run(running, cache, headers)

    async def _run(self, running: _Running, cache: BackendCache, headers: Mapping[str, str]) -> None:
        b = running.backend
        kv = b.kv_events
        assert kv is not None
        try:
            intake = self._intake(b, cache, headers)
        except zmq.ZMQError as exc:
            how = "bind" if kv.bind and self.relay_dir is None else "connect"
            running.failed = str(exc)
            raise IntakeDown(f"cannot {how} KV events endpoint {kv.endpoint}: {exc}; routing uses the "
                             "approximate index") from exc
        running.failed = None
        try:
            await intake.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the intake must not take the gateway down; routing falls back
            log.exception("backend %s: KV event intake stopped", b.name)
            cache.lose(0, "intake failed", self.caches.clock())
            raise IntakeDown(f"stopped: {exc!r}") from exc
        finally:
            intake.close()
        raise IntakeDown("stopped")  # (its loop has no end)

    async def _tick(self) -> None:
        while True:
            await self._sleep(TICK_S)
            for cache in self.caches.tick():
                running = self._running.get(cache.name)
                if running is None:
                    continue
                cache.hint = explain(running.backend, heard=cache.counter > 0, connected=cache.connected,
                                     failed=running.failed)
                log.warning("backend %s: %s", cache.name, cache.hint)

    def _stop(self, name: str) -> None:
        task = self._running.pop(name).task
        assert task is not None
        task.cancel()
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def close(self) -> None:
        tasks = [r.task for r in self._running.values() if r.task is not None] + list(self._stopping)
        if self._ticker is not None:
            tasks.append(self._ticker)
        await cancel_all(tasks)
        self._running.clear()
        self._ticker = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
