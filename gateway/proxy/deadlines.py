"""`asyncio.timeout` for the request path, at a fraction of its cost.

`asyncio.timeout` builds a rescheduleable Timeout object, looks up the task and reschedules on
exit: ~7 % of the gateway's CPU per proxied request in the profile (bench/results/profile.md). A
timer handle per request was still ~3 % (starting and cancelling a libuv timer). The request path
needs neither: its deadlines are seconds long and a few milliseconds of lateness do not matter. So
`Deadlines` keeps every deadline of a loop in slots of `tick_s` and runs one timer, at the earliest
slot that holds any; entering and leaving a `Deadline` is a set insertion and removal.

The semantics are the standard library's (`asyncio.timeout`, tested side by side in
tests/unit/gateway/test_deadline.py): when the delay passes (up to one tick late), the task is
cancelled and the CancelledError that comes out of the block becomes TimeoutError; a cancellation
from elsewhere (the client went away) stays a cancellation, also when it arrives together with the
expiry; nested deadlines each convert only their own expiry; a block that swallows the cancellation
exits normally, with the task's cancellation count restored.
"""

from __future__ import annotations

import asyncio
import heapq
from types import TracebackType
from typing import Final

TICK_S: Final = 0.01


class Deadlines:
    """The deadlines of one loop, behind one timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, tick_s: float = TICK_S) -> None:
        """`loop` is the running loop (passed in: finding it costs a getpid() syscall on 3.11)."""
        self.loop = loop
        self._tick_s = tick_s
        self._slots: dict[int, set[Deadline]] = {}
        self._due: list[int] = []  # heap of the slots in `_slots`
        self._timer: asyncio.TimerHandle | None = None
        self._timer_slot = 0

    def after(self, delay_s: float) -> Deadline:
        return Deadline(self, delay_s)

    def _add(self, deadline: Deadline, delay_s: float) -> int:
        slot = int((self.loop.time() + delay_s) / self._tick_s) + 1  # never early
        members = self._slots.get(slot)
        if members is None:
            members = self._slots[slot] = set()
            heapq.heappush(self._due, slot)
        members.add(deadline)
        if self._timer is None or slot < self._timer_slot:
            self._schedule(slot)
        return slot

    def _remove(self, deadline: Deadline, slot: int) -> None:
        members = self._slots.get(slot)
        if members is not None:
            members.discard(deadline)

    def _schedule(self, slot: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_slot = slot
        self._timer = self.loop.call_at(slot * self._tick_s, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = max(int(self.loop.time() / self._tick_s), self._timer_slot)  # (float rounding)
        due = self._due
        while due and due[0] <= now:
            for deadline in self._slots.pop(heapq.heappop(due)):
                deadline.expire()
        # the next slot that still holds a deadline (slots emptied by their blocks are dropped here)
        while due and not self._slots[due[0]]:
            del self._slots[heapq.heappop(due)]
        if due:
            self._schedule(due[0])

    @property
    def pending(self) -> int:
        return sum(len(members) for members in self._slots.values())


class Deadline:
    __slots__ = ("_cancelling", "_deadlines", "_delay_s", "_slot", "_task", "expired")

    def __init__(self, deadlines: Deadlines, delay_s: float) -> None:
        self._deadlines = deadlines
        self._delay_s = delay_s
        self._slot = 0
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.expired = False

    def __enter__(self) -> Deadline:
        task = asyncio.current_task(self._deadlines.loop)
        if task is None:
            raise RuntimeError("Deadline must be used inside a task of its loop")
        self._task = task
        self._cancelling = task.cancelling()
        self._slot = self._deadlines._add(self, self._delay_s)
        return self

    def expire(self) -> None:
        self.expired = True
        assert self._task is not None
        self._task.cancel()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._task is not None
        self._deadlines._remove(self, self._slot)
        if self.expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc
