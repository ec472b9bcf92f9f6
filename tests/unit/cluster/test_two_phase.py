"""The hub's two-phase reload, against a real hub on a real Unix socket, with workers played by
channels whose prepare answers what the test says: one refusal aborts it on every worker and the
hub keeps its committed generation and what it probes; agreement commits it everywhere, after the
new backends' first probes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.app import build_pool
from gateway.cluster.channel import Channel
from gateway.cluster.committed import Committed
from gateway.cluster.hub import Hub
from gateway.settings import load_settings
from gateway.state.health_feed import Finding
from gateway.state.reload import ReloadRejected
from tests.integration.fakes import RecordingBackend, start_recording_backend
from tests.polling import until


def config(*backends: RecordingBackend, names: tuple[str, ...]) -> dict[str, Any]:
    return {"backends": [{"name": n, "runtime": "vllm", "url": b.url, "model": "m"} for n, b in zip(names, backends,
                                                                                                      strict=True)],
            "routes": [{"model": "m", "backends": list(names)}], "health": {"interval_s": 0.05}}


@dataclass
class Worker:
    """A worker as the hub sees one: hello, state (ready), then prepare/commit/abort answered here."""

    slot: int
    refuse: bool = False
    calls: list[tuple[str, int]] = field(default_factory=list)
    found: list[Finding] = field(default_factory=list)
    probes_at_commit: dict[str, int] = field(default_factory=dict)
    channel: Channel | None = None
    task: asyncio.Task[None] | None = None
    seen: RecordingBackend | None = None  # whose probe count to note at commit

    async def connect(self, path: Path) -> None:
        reader, writer = await asyncio.open_unix_connection(str(path))
        channel = self.channel = Channel(reader, writer, {}, name=f"worker-{self.slot}")
        channel.handle("prepare", self.prepare)
        channel.handle("commit", self.commit)
        channel.handle("abort", self.abort)
        channel.handle("probes", lambda rows: self.found.extend(Finding.from_wire(r) for r in rows))
        self.task = asyncio.create_task(channel.run())
        await channel.call("hello", {"slot": self.slot, "pid": os.getpid()})
        await channel.call("state")  # attached: it takes part in reloads from now on

    def prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("prepare", int(body["number"])))
        return {"errors": ["routes.0.tokenizer: cannot be loaded here"]} if self.refuse else {}

    def commit(self, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("commit", int(body["number"])))
        if self.seen is not None:
            self.probes_at_commit["new"] = len(self.seen.probes)
        return {"generation": int(body["number"])}

    def abort(self, body: int) -> dict[str, Any]:
        self.calls.append(("abort", int(body)))
        return {}

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.task is not None:
            self.task.cancel()


@dataclass
class Rig:
    hub: Hub
    path: Path
    old: RecordingBackend
    new: RecordingBackend
    workers: list[Worker]


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    old, new = await start_recording_backend(), await start_recording_backend()
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config(old, names=("old",))))
    hub = Hub(Committed.first(load_settings(path), text=path.read_text(), source=str(path)), config_path=str(path),
              build_pool=build_pool)
    await hub.start(tmp_path / "hub.sock")
    workers = [Worker(0), Worker(1)]
    for w in workers:
        await w.connect(tmp_path / "hub.sock")
    yield Rig(hub, path, old, new, workers)
    for w in workers:
        await w.close()
    await hub.stop()
    for backend in (old, new):
        await backend.runner.cleanup()


async def test_one_refusal_aborts_everywhere_and_the_hub_changes_nothing(rig: Rig) -> None:
    rig.workers[1].refuse = True
    rig.path.write_text(yaml.safe_dump(config(rig.new, names=("new",))))  # drops `old`, adds `new`
    with pytest.raises(ReloadRejected) as refused:
        await rig.hub.reload()
    assert refused.value.errors == ["worker 1: routes.0.tokenizer: cannot be loaded here"]
    assert [w.calls for w in rig.workers] == [[("prepare", 2), ("abort", 2)]] * 2
    assert rig.hub.generation == 1
    assert rig.hub.settings.backends[0].name == "old"
    assert rig.hub.probes is not None
    assert rig.hub.probes.followed == ["old"]
    probed = len(rig.old.probes)
    await until(lambda: len(rig.old.probes) >= probed + 3, within_s=10.0)  # `old` is still probed ...
    assert rig.new.probes == []  # ... and the refused file's backend never was
    assert {f.backend for w in rig.workers for f in w.found} == {"old"}


async def test_agreement_commits_everywhere_after_the_new_backends_first_probe(rig: Rig) -> None:
    for w in rig.workers:
        w.seen = rig.new
    rig.path.write_text(yaml.safe_dump(config(rig.old, rig.new, names=("old", "new"))))
    done = await rig.hub.reload()
    assert done.generation == 2
    assert [w.calls for w in rig.workers] == [[("prepare", 2), ("commit", 2)]] * 2
    assert all(w.probes_at_commit["new"] >= 1 for w in rig.workers)  # probed before any worker switched
    assert rig.hub.probes is not None
    assert sorted(rig.hub.probes.followed) == ["new", "old"]
    assert rig.hub.probes.epochs == {"old": 1, "new": 2}  # `old` unchanged: its probes go on, epoch 1
    await until(lambda: any(f.backend == "new" for f in rig.workers[0].found), within_s=10.0)
    assert {f.epoch for f in rig.workers[0].found if f.backend == "new"} == {2}
    # a reload that drops `old`: it is probed no more
    rig.path.write_text(yaml.safe_dump(config(rig.new, names=("new",))))
    assert (await rig.hub.reload()).generation == 3
    probed = len(rig.old.probes)
    assert rig.hub.probes.followed == ["new"]
    seen = len(rig.new.probes)
    await until(lambda: len(rig.new.probes) >= seen + 3, within_s=10.0)
    assert len(rig.old.probes) == probed


async def test_a_refused_file_is_refused_by_the_hub_before_any_worker_hears_of_it(rig: Rig) -> None:
    rig.path.write_text("routes: [")
    with pytest.raises(ReloadRejected) as refused:
        await rig.hub.reload()
    assert refused.value.errors[0].startswith("<yaml>:")
    assert [w.calls for w in rig.workers] == [[], []]
    assert rig.hub.generation == 1


async def test_a_worker_still_building_is_listed_as_not_ready_without_a_generation(rig: Rig, tmp_path: Path) -> None:
    """A replacement is in `/admin/workers` from its hello; until it has built and attached, the hub
    asks it nothing, there or anywhere (issue 26's CI: a row without a generation was read as a
    built worker's; a worker busy building could hold a scrape up to the call's timeout)."""
    starting = Worker(2)
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "hub.sock"))
    starting.channel = Channel(reader, writer, {}, name="worker-2")
    asked: list[str] = []

    def answer(method: str) -> Callable[[Any], dict[str, Any]]:
        def handler(_: Any) -> dict[str, Any]:
            asked.append(method)
            return {"pid": 4242, "generation": 1}
        return handler

    for method in ("identity", "collect", "stats", "apply_weights"):
        starting.channel.handle(method, answer(method))
    starting.task = asyncio.create_task(starting.channel.run())
    try:
        await starting.channel.call("hello", {"slot": 2, "pid": 4242})
        doc = await rig.hub.workers_doc()
        row = next(r for r in doc["workers"] if r["worker"] == 2)
        assert row["ready"] is False
        assert "generation" not in row
        assert "error" not in row
        assert [(r["ready"], "error" in r) for r in doc["workers"] if r["worker"] != 2] == [(True, True)] * 2
        await rig.hub.metrics("text/plain")
        await rig.hub.compare(60, "replica")
        assert asked == []
        await starting.channel.call("state")
        row = next(r for r in (await rig.hub.workers_doc())["workers"] if r["worker"] == 2)
        assert row["ready"] is True
        assert row["generation"] == 1
    finally:
        await starting.close()
