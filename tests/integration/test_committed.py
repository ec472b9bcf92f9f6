"""`gateway serve --workers 2` runs one committed generation, owned by the supervisor: a worker that
(re)starts builds it, whatever the config file holds now; a slot whose worker cannot start stays
down and is reported while the others serve; a reload the workers refuse changes nothing anywhere,
not even what the supervisor probes.

Every request here opens its own connection (SO_REUSEPORT spreads connections over the workers)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from .fakes import RecordingBackend, run, start_recording_backend
from .harness import AS_JSON, ROOT, Emulators, GatewayProcess, LoopThread, backend_entry, kill_and_wait_gone, wait_for
from .test_workers import chat, fresh, scrape, total

Start = Callable[..., GatewayProcess]
TOKENIZER = ROOT / "tests" / "data" / "tiny-moe-tokenizer"


def workers_doc(gw: GatewayProcess) -> dict[str, Any]:
    doc: dict[str, Any] = fresh("GET", gw.url + "/admin/workers").json()
    return doc


def workers_doc_unless_reset(gw: GatewayProcess) -> dict[str, Any] | None:
    """`workers_doc`, or None when the connection was reset: right after a worker is killed, the
    connections the kernel had queued on its listener are reset (README, *a worker that dies*)."""
    try:
        return workers_doc(gw)
    except httpx.TransportError:
        return None


def kill_a_worker(gw: GatewayProcess, slot: int = 0) -> int:
    """SIGKILL the worker of `slot`, found in `/admin/workers`; wait until its replacement is
    built (`ready`) and counted. The replacement's pid."""
    before = workers_doc(gw)
    victim = next(r["pid"] for r in before["workers"] if r["worker"] == slot)
    kill_and_wait_gone(victim)
    doc = wait_for(lambda: workers_doc_unless_reset(gw),
                   lambda d: d is not None and len(d["workers"]) == 2 and victim not in {r["pid"] for r in d["workers"]}
                   and d["restarts"] == before["restarts"] + 1 and all(r["ready"] for r in d["workers"]),
                   timeout=60, what="a replacement worker, built, serving and counted")
    assert doc is not None
    return int(next(r["pid"] for r in doc["workers"] if r["pid"] not in {w["pid"] for w in before["workers"]}))


def edit(gw: GatewayProcess, change: Callable[[dict[str, Any]], None]) -> None:
    config = yaml.safe_load(gw.config_path.read_text())
    change(config)
    gw.config_path.write_text(yaml.safe_dump(config))


def test_a_restarted_worker_runs_the_committed_generation_not_the_edited_file(
    emulators: Emulators, gateway: Start, tmp_path: Path,
) -> None:
    """Issue 22 item 2: after an edit that was not reloaded (or whose reload was refused), a crashed
    worker came back with the new file while the other served the old generation (10-13 of 30 200,
    the rest 404)."""
    v = emulators.start("vllm")
    gw = gateway([backend_entry("v", v, "vllm")], workers=2)

    def rename(config: dict[str, Any]) -> None:
        config["routes"] = [{"model": "renamed", "backends": ["v"]}]

    edit(gw, rename)  # saved, not reloaded
    kill_a_worker(gw)
    assert [chat(gw).status_code for _ in range(30)] == [200] * 30
    assert {r["generation"] for r in workers_doc(gw)["workers"]} == {1}

    def refused(config: dict[str, Any]) -> None:  # valid YAML and settings; its tokenizer cannot be loaded
        config["routes"] = [{"model": "renamed", "backends": ["v"], "tokenizer": str(tmp_path / "missing")}]

    edit(gw, refused)
    reply = fresh("POST", gw.url + "/admin/reload", headers=AS_JSON)
    assert reply.status_code == 400
    assert any("tokenizer" in e for e in reply.json()["errors"])
    kill_a_worker(gw)
    assert [chat(gw).status_code for _ in range(30)] == [200] * 30
    doc = workers_doc(gw)
    assert doc["generation"] == 1
    assert {r["generation"] for r in doc["workers"]} == {1}
    assert doc["down"] == []


def test_an_invalid_file_on_disk_and_a_killed_worker_leave_the_gateway_serving(
    emulators: Emulators, gateway: Start,
) -> None:
    """Issue 22 item 2: with an invalid file on disk, the supervisor gave up after five failed starts
    and exited 1, taking down a gateway whose running config was valid."""
    v = emulators.start("vllm")
    gw = gateway([backend_entry("v", v, "vllm")], workers=2)
    gw.config_path.write_text("routes: [")
    first = kill_a_worker(gw)
    second = kill_a_worker(gw, slot=1)  # the other one too: both now started while the file was invalid
    assert gw.proc.poll() is None
    doc = workers_doc(gw)
    assert {r["pid"] for r in doc["workers"]} == {first, second}
    assert {r["generation"] for r in doc["workers"]} == {1}
    assert doc["down"] == []
    assert [chat(gw).status_code for _ in range(20)] == [200] * 20
    assert total(scrape(gw.url + "/metrics"), "gateway_worker_slots_down") == 0


def test_a_slot_whose_worker_cannot_start_stays_down_and_is_reported_while_the_other_serves(
    emulators: Emulators, gateway: Start, tmp_path: Path,
) -> None:
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, tokenizer)
    v = emulators.start("vllm")
    gw = gateway([backend_entry("v", v, "vllm")],
                 [{"model": "moe", "backends": ["v"], "tokenizer": str(tokenizer)}], workers=2)
    away = tmp_path / "tokenizer-away"
    tokenizer.rename(away)  # the committed generation's tokenizer is gone: a new worker cannot build it
    victim = workers_doc(gw)["workers"][0]
    kill_and_wait_gone(victim["pid"])
    doc = wait_for(lambda: workers_doc(gw), lambda d: len(d["down"]) == 1 and d["down"][0]["failed_starts"] >= 2,
                   timeout=60, what="the slot reported down after failed starts")
    [down] = doc["down"]
    assert down["worker"] == victim["worker"]
    assert "did not start" in down["last_error"]
    assert len(doc["workers"]) == 1
    assert [chat(gw).status_code for _ in range(20)] == [200] * 20  # the other worker serves
    page = scrape(gw.url + "/metrics")
    assert total(page, "gateway_worker_slots_down") == 1
    assert total(page, "gateway_worker_start_failures_total") >= 2
    assert "cannot build the committed generation" in gw.log_path.read_text()
    assert gw.proc.poll() is None  # the supervisor never gives up on a slot
    away.rename(tokenizer)
    wait_for(lambda: workers_doc(gw), lambda d: len(d["workers"]) == 2 and d["down"] == [], timeout=60,
             what="the slot back up once its worker can start")
    assert [chat(gw).status_code for _ in range(10)] == [200] * 10


def backends_view(gw: GatewayProcess) -> dict[str, tuple[bool, str | None]]:
    doc = fresh("GET", gw.url + "/admin/backends").json()
    return {b["name"]: (b["healthy"], b["url"]) for b in doc["backends"]}


def test_a_reload_the_workers_refuse_leaves_probes_and_health_as_they_were(
    emulators: Emulators, loop_thread: LoopThread, gateway: Start, tmp_path: Path,
) -> None:
    """Issue 22 item 3: the supervisor swapped its pool and prober before asking the workers: the
    refused file's backends were probed from then on, a backend it dropped never again, and that
    backend's last "ok" was re-applied for ever (a stopped backend stayed healthy)."""
    a, b = emulators.start("vllm"), emulators.start("vllm")
    c: RecordingBackend = run(loop_thread, start_recording_backend())  # type: ignore[assignment]
    try:
        gw = gateway([backend_entry("a", a, "vllm"), backend_entry("b", b, "vllm")],
                     [{"model": "moe", "backends": ["a", "b"], "policy": "round_robin"},
                      {"model": "only-b", "backends": ["b"]}], workers=2)
        before = [backends_view(gw) for _ in range(6)]
        assert all(view == before[0] for view in before)

        def refused(config: dict[str, Any]) -> None:  # drops b, adds c, and a tokenizer no one can load
            config["backends"] = [backend_entry("a", a, "vllm"),
                                  {"name": "c", "runtime": "vllm", "url": c.url, "model": "tiny-moe"}]
            config["routes"] = [{"model": "moe", "backends": ["a", "c"], "tokenizer": str(tmp_path / "missing")}]

        edit(gw, refused)
        reply = fresh("POST", gw.url + "/admin/reload", headers=AS_JSON)
        assert reply.status_code == 400
        assert reply.json()["error"]["code"] == "invalid_config"
        assert [backends_view(gw) for _ in range(6)] == before  # every worker: as before
        assert workers_doc(gw)["generation"] == 1
        emulators.stop(b)  # b is still configured: it is still probed, and found down
        wait_for(lambda: [backends_view(gw)["b"][0] for _ in range(6)], lambda seen: not any(seen), timeout=30,
                 what="b marked down on every worker")
        codes = [chat(gw).status_code for _ in range(12)]
        assert codes == [200] * 12  # a serves every request of the route both are in
        only_b = [chat(gw, "only-b") for _ in range(4)]
        assert [r.status_code for r in only_b] == [503] * 4  # the route whose only backend is down
        assert c.probes == []  # the refused file's backend was never probed
    finally:
        run(loop_thread, c.runner.cleanup())


def test_a_worker_restarting_during_a_reload_ends_on_the_committed_generation(
    emulators: Emulators, gateway: Start,
) -> None:
    v = emulators.start("vllm")
    gw = gateway([backend_entry("v", v, "vllm")], workers=2)
    victim = workers_doc(gw)["workers"][0]["pid"]

    def add_route(config: dict[str, Any]) -> None:
        config["routes"].append({"model": "added", "backends": ["v"]})

    edit(gw, add_route)
    kill_and_wait_gone(victim)
    reply = fresh("POST", gw.url + "/admin/reload", headers=AS_JSON)  # while the slot's replacement is starting
    assert reply.status_code == 200
    assert reply.json()["generation"] == 2
    doc = wait_for(lambda: workers_doc(gw),
                   lambda d: len(d["workers"]) == 2 and victim not in {r["pid"] for r in d["workers"]}
                   and all(r["ready"] for r in d["workers"]),
                   timeout=60, what="the replacement built and serving")
    assert {r["generation"] for r in doc["workers"]} == {2}
    assert [chat(gw, "added").status_code for _ in range(20)] == [200] * 20
