"""Fixtures shared by the tiers that run emulators in this process (integration, replicas,
conformance): each tier's conftest imports the ones it uses, so pytest registers them there."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .harness import Emulators, LoopThread


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    """One background event loop for the emulators of the whole session."""
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def emulators(loop_thread: LoopThread) -> Iterator[Emulators]:
    """`emulators.start(runtime, ...)` for one test; every emulator it started is stopped after."""
    emus = Emulators(loop_thread)
    yield emus
    emus.stop_all()
