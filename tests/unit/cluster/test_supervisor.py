"""The supervisor restarts a worker that exits, with backoff; a slot whose worker cannot start stays
down, reported and retried, while the others serve; only a start where no worker at all listens
fails (exit status 1). Workers here are tiny scripts that play a gateway worker's part: print the
listening line, then crash or stay up, as a counter file per slot tells them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from gateway.app import build_pool
from gateway.cluster.committed import Committed
from gateway.cluster.supervisor import Supervisor
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
written = counter.with_suffix(".new")
written.write_text(str(n + 1))
written.replace(counter)  # atomically: the test reads it meanwhile
plan = sys.argv[2:]
step = plan[min(n, len(plan) - 1)]
if step == "fail":
    sys.exit(2)
print("gateway listening on http://127.0.0.1:1", flush=True)
if step == "crash":
    sys.exit(3)
signal.pause()  # serve until the supervisor stops it
"""


def supervisor(tmp_path: Path, *plan: str, plans: dict[int, tuple[str, ...]] | None = None,
               workers: int = 1) -> tuple[Supervisor, Path]:
    """`plan` for every slot, or `plans` by slot; slot N counts its starts in `starts-N`."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)

    def argv(hub: Path, slot: int) -> list[str]:
        steps = plans[slot] if plans is not None else plan
        return [sys.executable, str(script), str(tmp_path / f"starts-{slot}"), *steps]

    sup = Supervisor(Committed.first(SETTINGS), host="127.0.0.1", port=1, workers=workers, config_path=None,
                     build_pool=build_pool, backoff_s=0.01, worker_argv=argv)
    return sup, tmp_path / "starts-0"


def starts(counter: Path) -> int:
    return int(counter.read_text()) if counter.exists() else 0


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


async def test_a_worker_that_cannot_start_again_leaves_its_slot_down_reported_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    sup, counter = supervisor(tmp_path, "crash", "fail")
    run = asyncio.create_task(sup.run(lambda url: None))
    await until(lambda: starts(counter) >= 8, within_s=60.0)  # retried again and again: never given up
    assert not run.done()
    assert sup.hub is not None
    [down] = sup.slots_down()
    assert down["worker"] == 0
    assert down["failed_starts"] >= 6
    assert "did not start (exit status 2" in down["last_error"]
    doc = await sup.hub.workers_doc()
    assert doc["down"][0]["worker"] == 0
    assert (sup.hub.registry.get_sample_value("gateway_worker_start_failures_total") or 0) >= 6
    assert sup.hub.registry.get_sample_value("gateway_worker_slots_down") == 1
    assert sup.hub.restart_count == 0
    assert "starting worker 0 failed" in caplog.text
    sup.stop()
    assert await run == 0


async def test_a_slot_that_comes_back_is_up_again_and_counted_as_a_restart(tmp_path: Path) -> None:
    sup, counter = supervisor(tmp_path, "crash", "fail", "fail", "serve")
    run = asyncio.create_task(sup.run(lambda url: None))
    await until(lambda: sup.hub is not None and sup.hub.restart_count == 1, within_s=60.0)
    assert sup.slots_down() == []
    assert starts(counter) == 4
    sup.stop()
    assert await run == 0


async def test_the_gateway_serves_while_a_slot_fails_from_the_start(tmp_path: Path) -> None:
    sup, _ = supervisor(tmp_path, plans={0: ("serve",), 1: ("fail", "fail", "serve")}, workers=2)
    served: list[int] = []
    run = asyncio.create_task(sup.run(lambda url: served.append(sup.serving)))
    await until(lambda: served == [1], within_s=60.0)  # listening with the one worker that started
    await until(lambda: sup.serving == 2, within_s=60.0)
    assert starts(tmp_path / "starts-1") == 3
    assert sup.slots_down() == []
    sup.stop()
    assert await run == 0


async def test_a_worker_that_never_starts_fails_the_start(tmp_path: Path) -> None:
    sup, counter = supervisor(tmp_path, "fail")
    urls: list[str] = []
    assert await asyncio.wait_for(sup.run(urls.append), 60) == 1
    assert urls == []
    assert counter.read_text() == "1"
