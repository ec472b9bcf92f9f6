"""Ending background tasks: the one way a component that owns asyncio tasks stops them.

Imports nothing of the gateway, so any room may use it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any


async def cancel_all(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel every task first (so none outlives another's teardown), then await each one. A task's
    `CancelledError` is its expected end and is swallowed; any other exception it ended with is
    raised here."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
