"""Fixtures for the emulator tests: emulators on real sockets (free ports), stopped after each test."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from backends.base import Runtime
from backends.emulator import DisaggConfig, EmulatorConfig, Faults, KvEventsConfig, RunningEmulator, start_emulator

FAST = 50.0  # speed factor: simulated seconds per wall second

MakeEmulator = Callable[..., Awaitable[RunningEmulator]]


@pytest.fixture
async def emulator() -> AsyncIterator[MakeEmulator]:
    """`await emulator("vllm", fail_first=2, model=...)` starts one; all are stopped at teardown."""
    started: list[RunningEmulator] = []

    async def make(
        runtime: str | Runtime, *, model: str = "tiny-moe", profile: str = "tiny", speed: float = FAST,
        max_model_len: int = 2048, seed: int = 0, prefix_reuse: bool | None = None,
        block_size: int | None = None, num_kv_blocks: int | None = None, embedding_dim: int | None = None,
        kv_events: KvEventsConfig | None = None, data_parallel_size: int = 1, disagg: DisaggConfig | None = None,
        **faults: Any,
    ) -> RunningEmulator:
        cfg = EmulatorConfig(
            runtime=Runtime(runtime), model=model, profile=profile, speed=speed, faults=Faults(**faults),
            max_model_len=max_model_len, seed=seed, prefix_reuse=prefix_reuse, block_size=block_size,
            num_kv_blocks=num_kv_blocks, embedding_dim=embedding_dim, kv_events=kv_events,
            data_parallel_size=data_parallel_size, disagg=disagg,
        )
        emu = await start_emulator(cfg, host="127.0.0.1", port=0)
        started.append(emu)
        return emu

    yield make
    for emu in started:
        await emu.stop()


@pytest.fixture(autouse=True)
def no_server_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail any test during which an emulator handler raised (aiohttp logs it and answers 500)."""
    caplog.set_level(logging.ERROR, logger="aiohttp.server")
    yield
    errors = [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
