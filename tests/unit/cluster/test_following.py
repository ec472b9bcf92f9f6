"""A worker's side of the committed generation, on a real hub and a real worker built in this
process: the worker builds what its hub committed (not the file), and one that was still starting
when a reload committed adopts the new generation as it attaches."""

from __future__ import annotations

from pathlib import Path

import yaml
from aiohttp import web

from gateway.app import build, build_pool
from gateway.cluster.committed import Committed
from gateway.cluster.hub import Hub
from gateway.cluster.link import WorkerLink
from gateway.settings import load_settings


def config(*routes: str) -> dict[str, object]:
    return {"backends": [{"name": "a", "runtime": "vllm", "url": "http://127.0.0.1:9", "model": "m"}],
            "routes": [{"model": r, "backends": ["a"]} for r in routes]}


async def test_a_worker_starting_during_a_reload_adopts_the_committed_generation(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config("m")))
    hub = Hub(Committed.first(load_settings(path), text=path.read_text(), source=str(path)), config_path=str(path),
              build_pool=build_pool)
    await hub.start(tmp_path / "hub.sock")
    runner: web.AppRunner | None = None
    link = await WorkerLink.connect(tmp_path / "hub.sock", 0)
    try:
        path.write_text("routes: [")  # what the file says now is not what the worker builds
        checked = link.check()
        built = await build(checked.settings, secrets=checked.secrets, link=link)
        assert built.generations.current.number == 1
        assert [r.model for r in built.generations.current.settings.routes] == ["m"]
        path.write_text(yaml.safe_dump(config("m", "n")))
        done = await hub.reload()  # the worker has not attached yet: it takes no part
        assert done.generation == 2
        assert built.generations.current.number == 1
        runner = web.AppRunner(built.app)
        await runner.setup()  # attaches and resyncs: adopts generation 2
        current = built.generations.current
        assert current.number == 2
        assert [r.model for r in current.settings.routes] == ["m", "n"]
        assert current.task is not None  # started once, by the adoption
        assert {c.slot: c.ready for c in hub.workers.values()} == {0: True}
        path.write_text(yaml.safe_dump(config("n")))
        assert (await hub.reload()).generation == 3  # attached now: it prepares and commits
        assert built.generations.current.number == 3
    finally:
        if runner is not None:
            await runner.cleanup()
        await link.close()
        await hub.stop()
