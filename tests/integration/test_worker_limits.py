"""`--workers N`: a key's limit is the host's, and the supervisor's one event loop is not on the
request path. A stalled supervisor (here: stopped with SIGSTOP, the extreme of a loop busy with
probe rounds and merges) neither delays admissions nor lets each worker admit a whole budget."""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Callable

import httpx

from gateway.access.secrets import hash_key

from .harness import Emulators, GatewayProcess, backend_entry

Start = Callable[..., GatewayProcess]
KEY = "sk-stall"


def timed_chat(gw: GatewayProcess) -> tuple[int, float]:
    body = {"model": "moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    started = time.perf_counter()
    with httpx.Client(timeout=30) as client:  # a new connection: either worker may take it
        status = client.post(gw.url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {KEY}"}).status_code
    return status, time.perf_counter() - started


def test_a_stalled_supervisor_neither_delays_admissions_nor_multiplies_the_budget(
    emulators: Emulators, gateway: Start,
) -> None:
    emu = emulators.start("vllm")
    key = {"id": "team", "key": hash_key(KEY), "requests_per_minute": 20}
    gw = gateway([backend_entry("v", emu, "vllm")], workers=2, auth={"api_keys": [key]})
    started = time.monotonic()
    before = [timed_chat(gw) for _ in range(8)]  # both workers hold leases on the host's bucket now
    assert [status for status, _ in before] == [200] * 8
    os.kill(gw.proc.pid, signal.SIGSTOP)  # the supervisor, and its hub, stop answering
    try:
        during = [timed_chat(gw) for _ in range(40)]
    finally:
        os.kill(gw.proc.pid, signal.SIGCONT)
    elapsed = time.monotonic() - started
    statuses = [status for status, _ in during]
    assert set(statuses) <= {200, 429}
    granted = 8 + statuses.count(200)
    # one budget for the host (the burst and what refilled), not one per worker (40 of 48)
    assert granted <= 20 + elapsed * 20 / 60 + 2, (granted, elapsed)
    assert granted >= 12  # and the workers kept admitting on their shares
    took = statistics.median(t for _, t in during)
    assert took < 0.5, f"admissions waited {took:.2f} s on the stalled supervisor"
