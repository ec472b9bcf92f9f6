"""The async driver: simulated durations become `duration / speed` of (here fake) sleep, and every
reported latency is in simulated seconds."""

from __future__ import annotations

import asyncio

from backends.base import Runtime
from backends.emulator.driver import EngineDriver, SubRequest
from backends.emulator.engine import Engine
from backends.emulator.prefix_cache import NoCache
from backends.emulator.profiles import PROFILES

PARAMS = PROFILES["tiny"].runtimes[Runtime.VLLM]


async def test_sleeps_are_simulated_durations_divided_by_speed() -> None:
    slept: list[float] = []
    wall = [0.0]

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)
        wall[0] += seconds
        await asyncio.sleep(0)

    driver = EngineDriver(Engine(PARAMS, NoCache()), speed=40.0, clock=lambda: wall[0], sleep=fake_sleep)
    driver.start()
    try:
        handle = driver.submit([SubRequest("a", list(range(3000)), 20, "length")])
        events = [await handle.next() for _ in range(20)]
    finally:
        await driver.stop()
    fin = events[-1].finished
    assert fin is not None
    assert fin.output_tokens == 20
    assert abs(sum(slept) * 40.0 - fin.e2e_s) < 1e-9
    assert all(s > 0 for s in slept)
    assert fin.ttft_s is not None
    assert fin.ttft_s > 3000 / PARAMS.prefill_tokens_per_s


async def test_abort_through_a_handle_stops_the_engine_request() -> None:
    gate = asyncio.Event()

    async def blocked_sleep(seconds: float) -> None:
        await gate.wait()

    driver = EngineDriver(Engine(PARAMS, NoCache()), speed=1.0, clock=lambda: 0.0, sleep=blocked_sleep)
    driver.start()
    try:
        handle = driver.submit([SubRequest("a", [1, 2, 3], 5, "length"), SubRequest("b", [1, 2, 3], 5, "length")])
        await asyncio.sleep(0)
        assert handle.abort() == 2
        assert driver.engine.idle
    finally:
        gate.set()
        await driver.stop()


async def test_loop_overhead_is_absorbed_by_the_next_sleep() -> None:
    """Each iteration costs 1 ms of wall time outside the sleep; the pacing subtracts it."""
    slept: list[float] = []
    wall = [0.0]

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)
        wall[0] += seconds + 0.001  # the sleep plus 1 ms of processing after it
        await asyncio.sleep(0)

    driver = EngineDriver(Engine(PARAMS, NoCache()), speed=1.0, clock=lambda: wall[0], sleep=fake_sleep)
    driver.start()
    try:
        handle = driver.submit([SubRequest("a", [1, 2, 3], 10, "length")])
        events = [await handle.next() for _ in range(10)]
    finally:
        await driver.stop()
    fin = events[-1].finished
    assert fin is not None
    assert abs(wall[0] - fin.e2e_s) <= 0.0011  # wall time tracks simulated time despite the overhead
