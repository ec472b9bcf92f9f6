"""Health is probed per backend: one backend that never answers delays no other backend's health
(`gateway serve --workers 2`: the supervisor probes, and forwards each result as it comes)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest

from .harness import Emulators, GatewayProcess, backend_entry, wait_for
from .test_workers import chat, fresh

Start = Callable[..., GatewayProcess]


@pytest.fixture
def hanging() -> Iterator[str]:
    """A backend whose socket accepts connections (the kernel does, into the backlog) and never
    answers anything: every probe of it runs into its timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def healthy_on_every_worker(gw: GatewayProcess, name: str) -> list[bool]:
    """What six answers of /admin/backends (new connections: any worker) say of `name`."""
    return [next(b["healthy"] for b in fresh("GET", gw.url + "/admin/backends").json()["backends"]
                 if b["name"] == name) for _ in range(6)]


def test_a_hanging_backend_does_not_delay_the_health_of_the_others(
    emulators: Emulators, gateway: Start, hanging: str,
) -> None:
    """Issue 22 item 8: a probe round waited for the slowest probe, scrape and model card, so a
    stopped backend elsewhere was marked down after 4.3-4.5 s instead of `interval_s`."""
    a, b = emulators.start("vllm"), emulators.start("vllm")
    gw = gateway([backend_entry("a", a, "vllm"), backend_entry("b", b, "vllm"),
                  {"name": "stuck", "runtime": "vllm", "url": hanging, "model": "tiny-moe"}],
                 [{"model": "moe", "backends": ["a", "b"], "policy": "round_robin"}], workers=2)
    interval_s = 0.2  # the fixture's health.interval_s; a probe's timeout is 5 s
    assert healthy_on_every_worker(gw, "b") == [True] * 6
    emulators.stop(b)
    stopped = time.monotonic()
    wait_for(lambda: healthy_on_every_worker(gw, "b"), lambda seen: not any(seen), timeout=30,
             what="b marked down on every worker")
    took = time.monotonic() - stopped
    assert took < interval_s + 2.5, f"b marked down {took:.1f} s after it stopped (a hanging probe delayed it)"
    assert [chat(gw).status_code for _ in range(10)] == [200] * 10
    assert healthy_on_every_worker(gw, "a") == [True] * 6
