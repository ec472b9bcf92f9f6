from __future__ import annotations

from gateway.access.ratelimit import KeyLimiter
from gateway.access.secrets import hash_key
from gateway.settings import ApiKey


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def key(**limits: int) -> ApiKey:
    return ApiKey(id="k", key=hash_key("secret"), **limits)


def test_requests_per_minute_admits_a_burst_then_asks_to_wait() -> None:
    clock = Clock()
    limiter = KeyLimiter(clock)
    k = key(requests_per_minute=3)
    assert [limiter.admit(k) for _ in range(3)] == [None, None, None]
    assert limiter.admit(k) == (20, "requests")  # one request refills every 60/3 s
    clock.now += 20
    assert limiter.admit(k) is None
    assert limiter.admit(k) is not None


def test_tokens_are_charged_after_the_request_and_block_until_refilled() -> None:
    clock = Clock()
    limiter = KeyLimiter(clock)
    k = key(tokens_per_minute=600)  # 10 tokens per second
    assert limiter.admit(k) is None
    limiter.charge(k, 700)  # the usage overshot the bucket: 100 tokens in debt
    assert limiter.admit(k) == (10, "tokens")
    clock.now += 10.5
    assert limiter.admit(k) is None


def test_the_spent_budget_is_named() -> None:
    clock = Clock()
    limiter = KeyLimiter(clock)
    k = key(requests_per_minute=100, tokens_per_minute=60)
    assert limiter.admit(k) is None
    limiter.charge(k, 120)
    assert limiter.admit(k) == (60, "tokens")


def test_a_key_without_limits_is_always_admitted() -> None:
    limiter = KeyLimiter(Clock())
    k = key()
    limiter.charge(k, 10**9)
    assert all(limiter.admit(k) is None for _ in range(1000))
