"""The background retry rule: tenacity's loop with our backoff, sleep and random generator injected."""

from __future__ import annotations

import logging
import random

import pytest

from gateway.retrying import Backoff, forever


class Sleeps:
    """An injected sleep that records what it was asked to wait and returns at once."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)


async def test_retries_with_doubling_capped_waits_until_success() -> None:
    sleeps, calls = Sleeps(), []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 6:
            raise ConnectionError("refused")
        return "up"

    async for attempt in forever(wait=Backoff(0.1, 1.0, jitter=0.0), sleep=sleeps, retry_on=ConnectionError):
        with attempt:
            result = await flaky()
    assert result == "up"
    assert sleeps.asked == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0])


async def test_other_exceptions_end_the_loop_at_once() -> None:
    sleeps = Sleeps()

    async def loop() -> None:
        async for attempt in forever(wait=Backoff(), sleep=sleeps, retry_on=ConnectionError):
            with attempt:
                raise KeyError("not a retryable failure")

    with pytest.raises(KeyError):
        await loop()
    assert sleeps.asked == []


async def test_each_failure_is_logged_before_its_sleep(caplog: pytest.LogCaptureFixture) -> None:
    sleeps, failures = Sleeps(), [OSError("down"), OSError("still down")]
    caplog.set_level(logging.WARNING)
    async for attempt in forever(wait=Backoff(0.5, 0.5, jitter=0.0), sleep=sleeps, retry_on=OSError,
                                 log=logging.getLogger("test.retry"), what="connecting to the store"):
        with attempt:
            if failures:
                raise failures.pop(0)
    lines = [r.getMessage() for r in caplog.records if r.name == "test.retry"]
    assert lines == ["connecting to the store failed (OSError: down): retrying in 0.5 s",
                     "connecting to the store failed (OSError: still down): retrying in 0.5 s"]


def test_jitter_only_shortens_and_comes_from_the_given_generator() -> None:
    a = [Backoff(4, 4, jitter=0.25, rng=random.Random(7)).delay(3) for _ in range(3)]
    b = [Backoff(4, 4, jitter=0.25, rng=random.Random(7)).delay(3) for _ in range(3)]
    assert a == b
    spread = Backoff(4, 4, jitter=0.25, rng=random.Random(1))
    delays = [spread.delay(9) for _ in range(200)]
    assert all(3.0 <= d <= 4.0 for d in delays)
    assert max(delays) - min(delays) > 0.5
