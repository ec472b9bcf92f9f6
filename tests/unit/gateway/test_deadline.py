"""Deadline behaves like asyncio.timeout where the request path relies on it."""

from __future__ import annotations

import asyncio

import pytest

from gateway.deadline import Deadline


async def test_expiry_turns_the_cancellation_into_timeout_error() -> None:
    never = asyncio.Event()
    with pytest.raises(TimeoutError), Deadline(0.01, asyncio.get_running_loop()):
        await never.wait()
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # nothing left pending on the task
    await asyncio.sleep(0)  # and the task is not cancelled afterwards


async def test_a_block_that_finishes_in_time_is_untouched() -> None:
    with Deadline(5.0, asyncio.get_running_loop()) as deadline:
        await asyncio.sleep(0)
    assert not deadline.expired


async def test_an_outside_cancellation_stays_a_cancellation() -> None:
    started = asyncio.Event()

    async def body() -> None:
        with Deadline(5.0, asyncio.get_running_loop()):
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(body())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_outside_a_task_it_refuses() -> None:
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[RuntimeError] = loop.create_future()

    def outside() -> None:  # a plain callback: no task is running
        try:
            with Deadline(1.0, loop):
                pass
        except RuntimeError as exc:
            refused.set_result(exc)

    loop.call_soon(outside)
    assert "inside a task" in str(await refused)
