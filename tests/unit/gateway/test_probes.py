"""Per-backend probe tasks over real sockets: a backend that never answers delays no other one, and
an unexpected exception in one probe is logged while every task goes on."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from backends.base import Load, Probe
from backends.delegating import DelegatingAdapter
from backends.registry import adapter_for
from gateway.settings import Backend
from gateway.state.pool import BackendState
from gateway.state.probes import ProbeTasks
from tests.integration.fakes import RecordingBackend, start_recording_backend
from tests.polling import until


class Results:
    """A `Record` that keeps what it is told, with when."""

    def __init__(self) -> None:
        self.probes: list[tuple[str, bool, float]] = []

    def record_probe(self, name: str, ok: bool, now: float, error: str | None = None) -> None:
        self.probes.append((name, ok, time.monotonic()))

    def record_load(self, name: str, load: Load, now: float) -> None:
        pass

    def of(self, name: str) -> list[bool]:
        return [ok for n, ok, _ in self.probes if n == name]


def state(name: str, url: str) -> BackendState:
    config = Backend.model_validate({"name": name, "runtime": "vllm", "url": url, "model": "m"})
    return BackendState(config=config, adapter=adapter_for(config.runtime))


class Exploding(DelegatingAdapter):
    """Its readiness probe description raises the first `times` it is asked (a bug, not a failure)."""

    def __init__(self, inner: DelegatingAdapter | object, times: int) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.times = times

    @property
    def readiness(self) -> Probe:
        if self.times > 0:
            self.times -= 1
            raise RuntimeError("a bug in a probe")
        return super().readiness


@pytest.fixture
async def backend() -> AsyncIterator[RecordingBackend]:
    found = await start_recording_backend()
    yield found
    await found.runner.cleanup()


@pytest.fixture
def hanging() -> Iterator[str]:
    with socket.socket() as listener:  # accepts (into the backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_a_backend_that_never_answers_delays_no_other(
    backend: RecordingBackend, hanging: str, session: aiohttp.ClientSession,
) -> None:
    results = Results()
    tasks = ProbeTasks(results, session, interval_s=0.05, clock=time.monotonic)
    fine, stuck = state("fine", backend.url), state("stuck", hanging)
    started = time.monotonic()
    tasks.follow([fine, stuck])
    try:
        await until(lambda: len(results.of("fine")) >= 10, within_s=4.0)  # long before a 5 s probe timeout
        assert results.of("stuck") == []  # its first probe is still waiting
        assert time.monotonic() - started < 4.5
    finally:
        await tasks.close()


async def test_an_unexpected_exception_in_a_probe_is_logged_and_probing_goes_on(
    backend: RecordingBackend, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture,
) -> None:
    results = Results()
    tasks = ProbeTasks(results, session, interval_s=0.02, clock=time.monotonic)
    buggy, fine = state("buggy", backend.url), state("fine", backend.url)
    buggy.adapter = Exploding(buggy.adapter, times=3)
    tasks.follow([buggy, fine])
    try:
        await until(lambda: len(results.of("buggy")) >= 3 and len(results.of("fine")) >= 6, within_s=10.0)
    finally:
        await tasks.close()
    assert set(results.of("buggy")) == {True}  # after three failures of its own code, it probes again
    assert caplog.text.count("readiness probe of backend buggy failed unexpectedly") == 3
    assert "RuntimeError: a bug in a probe" in caplog.text


async def test_follow_keeps_one_task_per_backend_and_stops_the_others(
    backend: RecordingBackend, session: aiohttp.ClientSession,
) -> None:
    results = Results()
    tasks = ProbeTasks(results, session, interval_s=0.02, clock=time.monotonic)
    a, b = state("a", backend.url), state("b", backend.url)
    tasks.follow([a, b])
    tasks.follow([a, b])  # again: no second task
    assert tasks.followed == [a, b]
    tasks.follow([a])
    try:
        assert tasks.followed == [a]
        seen = len(results.of("b"))
        await until(lambda: len(results.of("a")) >= 5, within_s=10.0)
        assert len(results.of("b")) == seen
    finally:
        await tasks.close()
    assert tasks.followed == []
