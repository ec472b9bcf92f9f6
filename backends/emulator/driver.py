"""Drives the pure `Engine` from an asyncio loop: sleeps each iteration's duration divided by `speed`.

Simulated time advances by exactly the iteration durations while the engine is busy, so latencies
reported by the emulator (metrics, e2e_latency, timing fields) are simulated seconds undistorted by
event-loop overhead. When the engine is idle, simulated time catches up with `wall time × speed` so
arrivals after a pause are stamped correctly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from backends.emulator.engine import Engine, Finished, Snapshot, StepResult, TokenEvent

MAX_LAG_S = 0.05  # wall seconds the loop may fall behind its timeline before it stops catching up


class StepObserver(Protocol):
    """Metrics sinks: told about every iteration, every finished or aborted request, and idleness."""

    def on_step(self, step: StepResult, snap: Snapshot) -> None: ...

    def on_finished(self, fin: Finished) -> None: ...

    def on_idle(self, snap: Snapshot) -> None: ...


@dataclass(frozen=True, slots=True)
class SubRequest:
    rid: str
    tokens: Sequence[int]
    output_tokens: int
    finish_reason: str
    external_tokens: int = 0  # leading prompt tokens whose KV was loaded from another server


class Handle:
    """The events of one client request (possibly several engine requests, e.g. `n > 1`)."""

    def __init__(self, driver: EngineDriver, rids: list[str]) -> None:
        self.rids = rids
        self.index_of = {rid: i for i, rid in enumerate(rids)}
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._driver = driver
        self._open = set(rids)

    @property
    def done(self) -> bool:
        return not self._open

    async def next(self) -> TokenEvent:
        ev = await self.queue.get()
        if ev.finished is not None:
            self._open.discard(ev.rid)
        return ev

    def abort(self) -> int:
        """Abort every unfinished engine request of this handle; returns how many were aborted."""
        n = 0
        for rid in list(self._open):
            if self._driver.abort(rid):
                n += 1
        self._open.clear()
        return n


class EngineDriver:
    def __init__(
        self,
        engine: Engine,
        *,
        speed: float,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.engine = engine
        self.speed = speed
        self._clock = clock
        self._sleep = sleep
        self._t0 = clock()
        self._sim = 0.0
        self._busy = False
        self._step_wall_start = 0.0
        self._step_end = 0.0
        self._next_wall = 0.0
        self._wake = asyncio.Event()
        self._handles: dict[str, Handle] = {}
        self.observers: list[StepObserver] = []
        self._task: asyncio.Task[None] | None = None

    def sim_now(self) -> float:
        """Idle: wall time x speed. Busy: interpolated inside the running iteration, never past its end,
        so an arrival mid-iteration is stamped when it arrived, not when the iteration started."""
        if not self._busy:
            self._sim = max(self._sim, (self._clock() - self._t0) * self.speed)
            return self._sim
        inside = (self._clock() - self._step_wall_start) * self.speed
        return min(self._step_end, self._sim + max(0.0, inside))

    def submit(self, subs: Sequence[SubRequest]) -> Handle:
        now = self.sim_now()
        handle = Handle(self, [s.rid for s in subs])
        for s in subs:
            self.engine.submit(s.rid, s.tokens, output_tokens=s.output_tokens, finish_reason=s.finish_reason, now_s=now,
                               external_tokens=s.external_tokens)
            self._handles[s.rid] = handle
        self._wake.set()
        return handle

    def abort(self, rid: str) -> bool:
        self._handles.pop(rid, None)
        fin = self.engine.abort(rid, self.sim_now())
        if fin is None:
            return False
        for o in self.observers:
            o.on_finished(fin)
        return True

    def refresh(self) -> None:
        """Tell the observers about a state change made outside an iteration (a request entering or
        leaving a KV transfer, blocks kept or freed) while the engine idles."""
        if not self._busy:
            snap = self.engine.snapshot()
            for o in self.observers:
                o.on_idle(snap)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="emulator-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        woken = False
        while True:
            # After idling, the iteration starts at the arrival that woke the engine, not when the event
            # loop got round to it (loop latency x speed would otherwise inflate every idle-time TTFT).
            now = self._sim if woken else self.sim_now()
            woken = False
            step = self.engine.step(now)
            if step is None:
                self._busy = False
                snap = self.engine.snapshot()
                for o in self.observers:
                    o.on_idle(snap)
                self._wake.clear()
                if self.engine.idle:
                    await self._wake.wait()
                    woken = True
                continue
            wall_now = self._clock()
            if not self._busy or wall_now - self._next_wall > MAX_LAG_S:
                self._next_wall = wall_now  # start a fresh wall timeline (after idling or falling behind)
            self._busy = True
            self._step_wall_start, self._step_end = self._next_wall, step.end_s
            # Pace iterations on a wall timeline, so event-loop overhead is absorbed by the next sleep
            # instead of accumulating (wall throughput then matches the model's).
            self._next_wall += step.duration_s / self.speed
            await self._sleep(max(0.0, self._next_wall - wall_now))
            self._sim = step.end_s
            snap = self.engine.snapshot()
            for o in self.observers:
                o.on_step(step, snap)
            for ev in step.tokens:
                if ev.finished is not None:
                    for o in self.observers:
                        o.on_finished(ev.finished)
                handle = self._handles.get(ev.rid)
                if handle is not None:
                    handle.queue.put_nowait(ev)
                    if ev.finished is not None:
                        del self._handles[ev.rid]
