"""Known traffic at known times: small builders shared by the stats tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backends.base import Usage
from gateway.observability.outcome import Gaps, Outcome
from gateway.settings import Settings, parse_settings
from gateway.stats.book import StatsBook

SETTINGS: dict[str, Any] = {
    "backends": [
        {"name": "v1", "runtime": "vllm", "url": "http://127.0.0.1:9001", "model": "m", "usd_per_hour": 96.0},
        {"name": "v2", "runtime": "vllm", "url": "http://127.0.0.1:9002", "model": "m", "usd_per_hour": 24.0},
        {"name": "s1", "runtime": "sglang", "url": "http://127.0.0.1:9003", "model": "m", "usd_per_hour": 48.0},
        {"name": "t1", "runtime": "trtllm", "url": "http://127.0.0.1:9004", "model": "m"},
    ],
    "routes": [
        {"model": "plain", "backends": ["v1", "v2", "s1", "t1"]},
        {"model": "ab", "split": {"arms": [{"name": "vllm", "weight": 1, "backends": ["v1"]},
                                            {"name": "sglang", "weight": 1, "backends": ["s1"]}]}},
    ],
}


def settings() -> Settings:
    return parse_settings(SETTINGS)


def book_with(*outcomes: Outcome) -> StatsBook:
    """A book of `settings()` started at 0, with `outcomes` recorded in order."""
    book = StatsBook(settings(), started_at=0.0)
    for o in outcomes:
        book.record(o)
    return book


RUNTIME = {"v1": "vllm", "v2": "vllm", "s1": "sglang", "t1": "trtllm"}


def outcome(
    backend: str, at: float, *, completion: int = 100, prompt: int = 50, cached: int | None = None,
    ttft: float | None = 0.1, gaps: Sequence[float] = (), duration: float = 1.0, status: str = "200",
    model: str = "plain", arm: str | None = None, sla: str | None = None, generation: float | None = None,
) -> Outcome:
    """A finished request; `generation` is its first-to-last-token time (None: all tokens at `at`)."""
    return Outcome(
        backend, RUNTIME.get(backend, "none"), model, status, duration,
        Usage(prompt, completion, cached), ttft, Gaps.of(gaps) if gaps else None,
        arm=arm, sla=sla, finished_at=at, generation_s=generation,
    )
