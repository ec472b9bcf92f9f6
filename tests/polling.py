"""Waiting for an observable state in async tests, on a deadline (tests never sleep to synchronise).
The sync counterpart for threads and processes is `tests.integration.harness.eventually`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(condition: Callable[[], bool], within_s: float = 10.0) -> None:
    """Poll `condition` on the running loop until it holds; fail after `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within_s} s")
        await asyncio.sleep(0.01)
