"""The supervisor restarts a worker that exits, with backoff, and gives up (exit status 1) on one
that cannot start again. Workers here are tiny scripts that play a gateway worker's part: print the
listening line, then crash or stay up, as a counter file tells them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from gateway.app import build_pool
from gateway.cluster.supervisor import MAX_START_FAILURES, Supervisor
from gateway.settings import parse_settings
from tests.polling import until

SETTINGS = parse_settings({
    "backends": [{"name": "nowhere", "runtime": "vllm", "url": "http://127.0.0.1:9", "model": "m"}],
    "routes": [{"model": "m", "backends": ["nowhere"]}],
})

# argv: counter file, then what each start does in turn: "crash" (listen, then exit 3), "serve"
# (listen and stay), "fail" (exit 2 before listening); the last one repeats.
WORKER = """
import sys, signal, pathlib
counter = pathlib.Path(sys.argv[1])
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
plan = sys.argv[2:]
step = plan[min(n, len(plan) - 1)]
if step == "fail":
    sys.exit(2)
print("gateway listening on http://127.0.0.1:1", flush=True)
if step == "crash":
    sys.exit(3)
signal.pause()  # serve until the supervisor stops it
"""


def supervisor(tmp_path: Path, *plan: str) -> tuple[Supervisor, Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    counter = tmp_path / "starts"
    sup = Supervisor(SETTINGS, host="127.0.0.1", port=1, workers=1, config_path=None, build_pool=build_pool,
                     backoff_s=0.01, worker_argv=lambda config, hub, slot: [sys.executable, str(script),
                                                                           str(counter), *plan])
    return sup, counter




async def test_a_crashed_worker_is_restarted_and_counted(tmp_path: Path) -> None:
    sup, counter = supervisor(tmp_path, "crash", "serve")
    urls: list[str] = []
    run = asyncio.create_task(sup.run(urls.append))
    await until(lambda: sup.hub is not None and sup.hub.restart_count == 1, within_s=30.0)
    assert sup.hub is not None
    assert urls == ["http://127.0.0.1:1"]
    assert counter.read_text() == "2"
    sup.stop()
    assert await run == 0
    assert sup.slots[0].proc is not None
    assert sup.slots[0].proc.returncode is not None  # stopped with the supervisor


async def test_a_worker_that_cannot_start_again_stops_the_gateway_with_status_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    sup, counter = supervisor(tmp_path, "crash", "fail")
    assert await asyncio.wait_for(sup.run(lambda url: None), 60) == 1
    assert counter.read_text() == str(1 + MAX_START_FAILURES)
    assert sup.hub is not None
    assert sup.hub.restart_count == 0
    assert "giving up" in caplog.text


async def test_a_worker_that_never_starts_fails_the_start(tmp_path: Path) -> None:
    sup, counter = supervisor(tmp_path, "fail")
    urls: list[str] = []
    assert await asyncio.wait_for(sup.run(urls.append), 60) == 1
    assert urls == []
    assert counter.read_text() == "1"
