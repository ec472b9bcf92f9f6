from __future__ import annotations

import pytest

from gateway.access.ratelimit import KeyLimiter, duration
from gateway.access.secrets import hash_key
from gateway.settings import ApiKey


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def limiter(clock: Clock) -> KeyLimiter:
    return KeyLimiter(clock)


def key(**limits: int) -> ApiKey:
    return ApiKey(id="k", key=hash_key("secret"), **limits)


def test_requests_per_minute_admits_a_burst_then_asks_to_wait(clock: Clock, limiter: KeyLimiter) -> None:
    k = key(requests_per_minute=3)
    assert [limiter.admit(k) for _ in range(3)] == [None, None, None]
    assert limiter.admit(k) == (20, "requests")  # one request refills every 60/3 s
    clock.now += 20
    assert limiter.admit(k) is None
    assert limiter.admit(k) is not None


def test_tokens_are_charged_after_the_request_and_block_until_refilled(clock: Clock, limiter: KeyLimiter) -> None:
    k = key(tokens_per_minute=600)  # 10 tokens per second
    assert limiter.admit(k) is None
    limiter.charge(k, 700)  # the usage overshot the bucket: 100 tokens in debt
    assert limiter.admit(k) == (10, "tokens")
    clock.now += 10.5
    assert limiter.admit(k) is None


def test_the_spent_budget_is_named(limiter: KeyLimiter) -> None:
    k = key(requests_per_minute=100, tokens_per_minute=60)
    assert limiter.admit(k) is None
    limiter.charge(k, 120)
    assert limiter.admit(k) == (60, "tokens")


def test_a_key_without_limits_is_always_admitted(limiter: KeyLimiter) -> None:
    k = key()
    limiter.charge(k, 10**9)
    assert all(limiter.admit(k) is None for _ in range(1000))


def test_openai_rate_limit_headers_state_limit_remaining_and_reset(limiter: KeyLimiter) -> None:
    k = key(requests_per_minute=60, tokens_per_minute=6000)
    assert limiter.admit(k) is None
    limiter.charge(k, 150)
    assert limiter.headers(k) == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59", "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": "5850", "x-ratelimit-reset-tokens": "1.5s",
    }
    assert limiter.headers(key()) == {}
    only_requests = key(requests_per_minute=3)
    assert set(limiter.headers(only_requests)) == {
        "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"}


def test_the_exact_wait_is_known_for_retry_after_ms(clock: Clock, limiter: KeyLimiter) -> None:
    k = key(requests_per_minute=3)
    for _ in range(3):
        limiter.admit(k)
    clock.now += 12.5
    assert limiter.admit(k) == (8, "requests")
    assert limiter.wait_s(k, "requests") == pytest.approx(7.5)


@pytest.mark.parametrize(("seconds", "text"), [
    (0.0, "0ms"), (0.25, "250ms"), (1.0, "1s"), (1.5, "1.5s"), (60.0, "1m0s"), (360.0, "6m0s"), (3723.5, "1h2m3.5s"),
])
def test_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_a_changed_limit_rescales_the_bucket_and_never_refills_it(clock: Clock, limiter: KeyLimiter) -> None:
    """A reload (or an `api_keys_file` re-read) that changes a key's limit keeps the bucket as full
    as it was, as a fraction: a spent bucket stays spent, whichever way the limit moves."""
    five, six = key(requests_per_minute=5), key(requests_per_minute=6)
    assert [limiter.admit(five) for _ in range(5)] == [None] * 5
    admitted = sum(limiter.admit(six if i % 2 else five) is None for i in range(30))  # flipping back and forth
    assert admitted == 0
    clock.now += 30  # half a minute: half full, at either limit
    assert limiter.levels(six)["requests"] == pytest.approx(3.0)
    assert limiter.levels(five)["requests"] == pytest.approx(2.5)


def test_an_overdrawn_token_bucket_keeps_its_time_until_full(clock: Clock, limiter: KeyLimiter) -> None:
    small, large = key(tokens_per_minute=600), key(tokens_per_minute=1200)
    assert limiter.admit(small) is None
    limiter.charge(small, 1800)  # 2 budgets below zero: 3 minutes until full
    assert limiter.admit(large) == (120, "tokens")  # -2400 at 20 a second
