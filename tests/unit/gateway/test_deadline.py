"""Deadline behaves like asyncio.timeout where the request path relies on it, behind one shared timer."""

from __future__ import annotations

import asyncio

import pytest

from gateway.proxy.deadlines import Deadlines


def deadlines() -> Deadlines:
    return Deadlines(asyncio.get_running_loop(), tick_s=0.005)


async def test_expiry_turns_the_cancellation_into_timeout_error() -> None:
    never = asyncio.Event()
    with pytest.raises(TimeoutError), deadlines().after(0.01):
        await never.wait()
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # nothing left pending on the task
    await asyncio.sleep(0)  # and the task is not cancelled afterwards


async def test_expiry_is_never_early_and_at_most_a_tick_late() -> None:
    shared = deadlines()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError), shared.after(0.05):
        await asyncio.Event().wait()
    waited = loop.time() - started
    assert waited >= 0.05
    assert waited < 0.05 + 0.005 + 0.05  # one tick, plus scheduling slack on a busy machine


async def test_a_block_that_finishes_in_time_is_untouched_and_forgotten() -> None:
    shared = deadlines()
    with shared.after(5.0) as deadline:
        await asyncio.sleep(0)
    assert not deadline.expired
    assert shared.pending == 0


async def test_many_blocks_share_the_timer_and_only_the_late_ones_expire() -> None:
    shared = deadlines()
    release = asyncio.Event()
    outcomes: dict[int, str] = {}

    async def block(i: int, delay_s: float) -> None:
        try:
            with shared.after(delay_s):
                await release.wait()
            outcomes[i] = "done"
        except TimeoutError:
            outcomes[i] = "timeout"
            if all(k in outcomes for k in range(0, 20, 2)):
                release.set()  # every short one has expired: let the long ones finish

    tasks = [asyncio.create_task(block(i, 0.02 if i % 2 == 0 else 30.0)) for i in range(20)]
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert outcomes == {i: "timeout" if i % 2 == 0 else "done" for i in range(20)}
    assert shared.pending == 0


async def test_an_earlier_deadline_added_later_still_fires_on_time() -> None:
    shared = deadlines()
    release = asyncio.Event()

    async def long() -> None:
        with shared.after(30.0):
            await release.wait()

    holder = asyncio.create_task(long())
    await asyncio.sleep(0)  # the shared timer now waits 30 s
    with pytest.raises(TimeoutError), shared.after(0.02):
        await asyncio.Event().wait()
    release.set()
    await holder


async def test_an_outside_cancellation_stays_a_cancellation() -> None:
    started = asyncio.Event()
    shared = deadlines()

    async def body() -> None:
        with shared.after(5.0):
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(body())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert shared.pending == 0


async def test_outside_a_task_it_refuses() -> None:
    loop = asyncio.get_running_loop()
    shared = deadlines()
    refused: asyncio.Future[RuntimeError] = loop.create_future()

    def outside() -> None:  # a plain callback: no task is running
        try:
            with shared.after(1.0):
                pass
        except RuntimeError as exc:
            refused.set_result(exc)

    loop.call_soon(outside)
    assert "inside a task" in str(await refused)
