"""`gateway serve --workers N` is one gateway: both workers serve, every scrape and every comparison
covers both, admin writes reach both before the reply, health is probed once, a key's limit holds
for the whole gateway, and a worker that dies is restarted without any counter going backwards.

Every request here opens its own connection (the kernel spreads connections over the workers with
SO_REUSEPORT; one keep-alive connection would stay on one worker and prove nothing)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.access.secrets import hash_key

from .fakes import run, start_recording_backend
from .harness import (
    AS_JSON,
    ROOT,
    Emulators,
    GatewayProcess,
    LoopThread,
    backend_entry,
    eventually,
    kill_and_wait_gone,
    wait_for,
)

Start = Callable[..., GatewayProcess]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def fresh(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """One request on a new connection (so any worker may answer it)."""
    with httpx.Client(timeout=30) as client:
        return client.request(method, url, **kwargs)


def chat(gw: GatewayProcess, model: str = "moe", **kwargs: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return fresh("POST", gw.url + "/v1/chat/completions", json=body, **kwargs)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = fresh("GET", url).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def total(page: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, lv), v in page.items() if n == name and all((k, x) in lv for k, x in labels.items()))


SPLIT = {"model": "ab", "policy": "round_robin", "split": {"arms": [
    {"name": "vllm", "weight": 50, "backends": ["v"]}, {"name": "sglang", "weight": 50, "backends": ["s"]}]}}


@pytest.fixture
def two_workers(emulators: Emulators, gateway: Start) -> GatewayProcess:
    v, s = emulators.start("vllm"), emulators.start("sglang")
    backends = [backend_entry("v", v, "vllm", usd_per_hour=10.0), backend_entry("s", s, "sglang", usd_per_hour=20.0)]
    routes = [{"model": "moe", "backends": ["v", "s"], "policy": "round_robin"}, SPLIT]
    return gateway(backends, routes, workers=2)


def test_workers_share_the_port_and_stop_together(emulators: Emulators, tmp_path: Path) -> None:
    emu = emulators.start("vllm")
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"backends": [backend_entry("v", emu, "vllm")],
                                      "routes": [{"model": "moe", "backends": ["v"]}]}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--host", "127.0.0.1", "--port", "0",
         "--workers", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("gateway listening on "), line
        assert "(2 workers)" in line
        url = line.split()[3]
        assert len(children(proc.pid)) == 2
        for _ in range(20):  # new clients each time: new connections, spread over the workers
            with openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
                reply = client.with_options(timeout=10).chat.completions.create(
                    model="moe", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                assert reply.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        eventually(lambda: not _group_alive(proc.pid), timeout=10)  # no worker outlives the supervisor
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()


def test_both_workers_serve_generation_requests(two_workers: GatewayProcess) -> None:
    gw = two_workers
    pids = set(children(gw.proc.pid))
    assert len(pids) == 2
    for _ in range(40):
        assert chat(gw).status_code == 200
    doc = fresh("GET", gw.url + "/admin/workers").json()
    served = {row["pid"]: row["requests"] for row in doc["workers"]}
    assert set(served) == pids
    assert sum(served.values()) == 40
    assert all(n > 0 for n in served.values()), served  # a dead or idle worker would show 0
    answered = wait_for(lambda: {fresh("GET", gw.url + "/admin/workers").json()["answered_by"] for _ in range(8)},
                        lambda seen: seen == {0, 1}, what="admin answers from both workers")
    assert answered == {0, 1}


def test_every_scrape_reports_the_whole_gateway(two_workers: GatewayProcess) -> None:
    """Issue 14's symptom: ten scrapes after 60 requests read 31, 31, 29, ... (one worker each)."""
    gw = two_workers
    for i in range(60):
        assert chat(gw, "moe" if i % 2 else "ab").status_code == 200
    pages = [scrape(gw.url + "/metrics") for _ in range(10)]
    assert [total(p, "gateway_requests_total") for p in pages] == [60.0] * 10
    assert [total(p, "gen_ai_server_request_duration_seconds_count") for p in pages] == [60.0] * 10
    assert [total(p, "gateway_arm_requests_total") for p in pages] == [30.0] * 10
    page = pages[-1]
    assert total(page, "gateway_tokens_total", kind="completion") == total(
        page, "gen_ai_client_token_usage_sum", gen_ai_token_type="output")
    assert total(page, "gateway_workers") == 2
    assert total(page, "gateway_backend_up", backend="v") == 1  # one probe's view, not the sum of two
    assert total(page, "gateway_backend_usd_per_hour", backend="v") == 10.0
    assert total(page, "gateway_build_info") == 1
    assert total(page, "gateway_backend_in_flight") == 0
    assert total(page, "process_cpu_seconds_total") > 0


def test_admin_writes_reach_every_worker_before_the_reply(two_workers: GatewayProcess) -> None:
    gw = two_workers
    put = fresh("PUT", gw.url + "/admin/routes/ab/weights", json={"weights": {"vllm": 90, "sglang": 10}})
    assert put.status_code == 200
    assert put.json()["weights"] == {"vllm": 90.0, "sglang": 10.0}
    seen = [fresh("GET", gw.url + "/admin/routes/ab/weights").json()["weights"] for _ in range(16)]
    assert all(w == {"vllm": 90.0, "sglang": 10.0} for w in seen)
    bad = fresh("PUT", gw.url + "/admin/routes/ab/weights", json={"weights": {"nope": 1}})
    assert bad.status_code == 400  # validated where it landed; nothing changed anywhere
    assert fresh("PUT", gw.url + "/admin/routes/moe/weights", json={"weights": {"a": 1}}).status_code == 404
    # a reload that changes the split: every worker has the file's new weights when POST returns
    config = yaml.safe_load(gw.config_path.read_text())
    config["routes"][1]["split"]["arms"][0]["weight"] = 25
    gw.config_path.write_text(yaml.safe_dump(config))
    reloaded = fresh("POST", gw.url + "/admin/reload", headers=AS_JSON)
    assert reloaded.status_code == 200
    assert reloaded.json()["generation"] == 2
    seen = [fresh("GET", gw.url + "/admin/routes/ab/weights").json()["weights"] for _ in range(16)]
    assert all(w == {"vllm": 25.0, "sglang": 50.0} for w in seen)
    assert {row["generation"] for row in fresh("GET", gw.url + "/admin/workers").json()["workers"]} == {2}
    # SIGHUP to the supervisor reloads every worker too
    config["routes"][1]["split"]["arms"][0]["weight"] = 5
    gw.config_path.write_text(yaml.safe_dump(config))
    os.kill(gw.proc.pid, signal.SIGHUP)
    wait_for(lambda: fresh("GET", gw.url + "/admin/workers").json(),
             lambda doc: doc["generation"] == 3 and {r["generation"] for r in doc["workers"]} == {3},
             what="generation 3 on every worker")
    seen = [fresh("GET", gw.url + "/admin/routes/ab/weights").json()["weights"] for _ in range(16)]
    assert all(w == {"vllm": 5.0, "sglang": 50.0} for w in seen)
    gw.config_path.write_text("routes: [")  # invalid: rejected for all, the old config keeps serving
    rejected = fresh("POST", gw.url + "/admin/reload", headers=AS_JSON)
    assert rejected.status_code == 400
    assert rejected.json()["error"]["code"] == "invalid_config"


def test_the_comparison_covers_every_worker(two_workers: GatewayProcess) -> None:
    gw = two_workers
    for _ in range(30):
        assert chat(gw).status_code == 200
    metrics = scrape(gw.url + "/metrics")
    tokens = total(metrics, "gateway_tokens_total", kind="completion", backend="v")

    def doc() -> dict[str, Any]:
        got: dict[str, Any] = fresh("GET", gw.url + "/admin/compare?window=60").json()
        return got

    # the last request's second must be over before the window counts it
    found = wait_for(doc, lambda d: d["total"]["requests"] == 30, what="30 requests in the comparison")
    assert found["scope"] == "replica"
    assert found["workers"] == 2
    v = next(b for b in found["backends"] if b["name"] == "v")
    assert v["output_tokens"] == tokens  # both workers' tokens, not one worker's share
    tps = v["output_tokens_per_s"]
    assert v["cost"]["usd_per_million_output_tokens"] == pytest.approx(10.0 / (3600 * tps) * 1e6)
    for window in (60, 300):  # any worker answers the same figures
        answers = {fresh("GET", gw.url + f"/admin/compare?window={window}").json()["total"]["requests"]
                   for _ in range(6)}
        assert answers == {30}


def test_health_is_probed_once_per_interval_for_the_whole_gateway(
    loop_thread: LoopThread, gateway: Start,
) -> None:
    backend: Any = run(loop_thread, start_recording_backend())
    try:
        gw = gateway([{"name": "r", "runtime": "vllm", "url": backend.url, "model": "tiny-moe"}], workers=2)
        interval = 0.2  # the fixture's health.interval_s
        start = time.monotonic()
        wait_for(lambda: len([t for t in backend.probes if t > start]), lambda n: n >= 16, timeout=30,
                 what="16 probes")
        recent = [t for t in backend.probes if t > start]
        rate = (len(recent) - 1) / (recent[-1] - recent[0])
        assert rate <= 1.25 / interval, f"{rate:.1f} probes/s: every worker probes (expected one prober)"
        assert chat(gw).status_code == 200
    finally:
        run(loop_thread, backend.runner.cleanup())


def test_a_keys_rate_limit_holds_for_the_whole_gateway(emulators: Emulators, gateway: Start) -> None:
    emu = emulators.start("vllm")
    key = {"id": "team", "key": hash_key("sk-team"), "requests_per_minute": 20}
    gw = gateway([backend_entry("v", emu, "vllm")], workers=2, auth={"api_keys": [key]})
    started = time.monotonic()
    replies = [chat(gw, headers={"Authorization": "Bearer sk-team"}) for _ in range(40)]
    elapsed = time.monotonic() - started
    codes = [r.status_code for r in replies]
    remaining = [int(r.headers["x-ratelimit-remaining-requests"]) for r in replies[:10]]
    assert remaining[0] == 19
    # each worker says what it saw of the host's bucket at its last settle (at most 0.5 s ago) plus the
    # units it holds: two workers' figures may differ by a lease, but they count down (that it is one
    # bucket for both is the granted count below)
    assert all(0 <= r <= 19 for r in remaining)
    assert remaining[-1] <= 19 - 5, remaining
    granted = codes.count(200)
    assert set(codes) <= {200, 429}
    assert 20 <= granted <= 20 + elapsed * 20 / 60 + 1  # the burst plus what refilled, not twice the budget
    page = scrape(gw.url + "/metrics")
    assert total(page, "gateway_key_requests_total", key="team", status="429") == 40 - granted


def test_a_dead_worker_is_restarted_and_no_counter_goes_backwards(two_workers: GatewayProcess) -> None:
    gw = two_workers
    assert fresh("PUT", gw.url + "/admin/routes/ab/weights", json={"weights": {"vllm": 80, "sglang": 20}}
                 ).status_code == 200
    for _ in range(20):
        assert chat(gw).status_code == 200
    before = scrape(gw.url + "/metrics")
    assert total(before, "gateway_requests_total") == 20
    victim, survivor = sorted(children(gw.proc.pid))
    kill_and_wait_gone(victim)
    replaced = wait_for(lambda: set(children(gw.proc.pid)), lambda pids: len(pids) == 2 and victim not in pids,
                        timeout=60, what="a replacement worker")
    assert survivor in replaced
    doc = wait_for(lambda: fresh("GET", gw.url + "/admin/workers").json(),
                   # the replacement connects before the supervisor's wait for it returns and counts it
                   lambda d: {r["pid"] for r in d["workers"]} == replaced and d["restarts"] >= 1, timeout=30,
                   what="both workers connected and the restart counted")
    assert doc["restarts"] == 1
    after = scrape(gw.url + "/metrics")
    assert total(after, "gateway_worker_restarts_total") == 1
    for (name, labels), value in before.items():  # every counter and histogram kept its value
        if name.endswith(("_total", "_count", "_bucket")) and not name.startswith("process_"):
            assert after.get((name, labels), 0.0) >= value, (name, labels)
    seen = [fresh("GET", gw.url + "/admin/routes/ab/weights").json()["weights"] for _ in range(12)]
    assert all(w == {"vllm": 80.0, "sglang": 20.0} for w in seen)  # the new worker has the live weights
    for _ in range(10):
        assert chat(gw).status_code == 200
    assert total(scrape(gw.url + "/metrics"), "gateway_requests_total") == 30
    assert "exited with status -9; restarting it" in gw.log_path.read_text()


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port some other program holds (without SO_REUSEPORT): no worker can bind it."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_the_supervisor_exits_non_zero_when_a_worker_cannot_start(
    emulators: Emulators, tmp_path: Path, taken_port: int,
) -> None:
    emu = emulators.start("vllm")
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"backends": [backend_entry("v", emu, "vllm")],
                                      "routes": [{"model": "moe", "backends": ["v"]}]}))
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--host", "127.0.0.1", "--port",
         str(taken_port), "--workers", "2"], cwd=ROOT, capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 1
    assert "did not start" in proc.stderr
    assert "gateway listening on" not in proc.stdout


def test_metrics_on_their_own_port_cover_every_worker(emulators: Emulators, gateway: Start) -> None:
    emu = emulators.start("vllm")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    gw = gateway([backend_entry("v", emu, "vllm")], workers=2,
                 listen={"host": "127.0.0.1", "port": 0, "metrics_port": metrics_port})
    for _ in range(12):
        assert chat(gw).status_code == 200
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    assert [total(scrape(url), "gateway_requests_total") for _ in range(5)] == [12.0] * 5
    assert fresh("GET", gw.url + "/metrics").status_code == 404
