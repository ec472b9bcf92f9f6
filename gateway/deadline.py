"""`asyncio.timeout` for the request path, at a fraction of its cost.

`asyncio.timeout` builds a rescheduleable Timeout object, looks up the task and reschedules on
exit: ~7 % of the gateway's CPU per proxied request in the profile (bench/results/profile.md). The
request path needs none of its flexibility: one fixed delay, one timer handle, cancelled on exit.
The semantics are the standard library's: when the delay passes, the task is cancelled and the
CancelledError that comes out of the block becomes TimeoutError; a cancellation from elsewhere (the
client went away) stays a cancellation.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class Deadline:
    __slots__ = ("_delay_s", "_handle", "_loop", "_task", "expired")

    def __init__(self, delay_s: float, loop: asyncio.AbstractEventLoop) -> None:
        """`loop` is the running loop (passed in: finding it costs a getpid() syscall on 3.11)."""
        self._delay_s = delay_s
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[object] | None = None
        self.expired = False

    def __enter__(self) -> Deadline:
        task = asyncio.current_task(self._loop)
        if task is None:
            raise RuntimeError("Deadline must be used inside a task of its loop")
        self._task = task
        self._handle = self._loop.call_later(self._delay_s, self._expire)
        return self

    def _expire(self) -> None:
        self.expired = True
        assert self._task is not None
        self._task.cancel()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._handle is not None
        assert self._task is not None
        self._handle.cancel()
        if self.expired and self._task.uncancel() == 0 and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc
