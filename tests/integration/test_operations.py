"""Operations: a backend resetting before the first byte, atomic config reload (HTTP and SIGHUP),
draining on SIGTERM, and exact accounting of every request and token over a fault-injection run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from .fakes import ResettingServer, start_resetting_server
from .harness import ROOT, Emulators, GatewayProcess, LoopThread, backend_entry, eventually
from .test_bad_input import address
from .test_errors import assert_openai_error

StartGateway = Callable[..., GatewayProcess]
CHAT = {"model": "moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def resetter(loop_thread: LoopThread) -> Iterator[ResettingServer]:
    server = loop_thread.run(start_resetting_server())
    yield server
    server.server.close()


def test_a_backend_resetting_after_the_request_was_sent_is_a_502_and_never_resent(
    resetter: ResettingServer, emulators: Emulators, gateway: StartGateway
) -> None:
    """The connection closed after the request was written: the engine may have done the work, so the
    request is not sent anywhere else (Envoy's `reset`, not `connect-failure`)."""
    ok = emulators.start("vllm")
    gw = gateway(
        [{"name": "reset", "runtime": "vllm", "url": resetter.url, "model": "tiny-moe"},
         backend_entry("ok", ok, "vllm")],
        health={"interval_s": 60.0, "failure_threshold": 100, "cooldown_s": 1.0},
    )
    answers = []
    for stream in (False, True, False, True):
        resp = gw.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        answers.append(resp.status_code)
        if resp.status_code == 502:
            assert resp.json()["error"]["code"] == "bad_gateway"
    assert sorted(answers) == [200, 200, 502, 502]  # round robin: every other request meets the reset
    assert len(resetter.accepted) == 2
    assert ok.stats.requests_received == 2
    assert gw.metric("gateway_retries_total", backend="reset") == 0
    assert gw.metric("gateway_requests_total", backend="reset", status="502") == 2


def write_config(gw: GatewayProcess, config: dict[str, Any]) -> None:
    (gw.log_path.parent / "gateway.yaml").write_text(yaml.safe_dump(config))


def stalled_stream(gw: GatewayProcess, max_tokens: int = 1500) -> socket.socket:
    """A long stream whose client does not read (tiny receive window): it stays in flight, paused at the
    transport's high-water mark, until the test starts reading it."""
    body = orjson.dumps({"model": "moe", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                         "messages": [{"role": "user", "content": "go"}]})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(address(gw))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
        if chunk.endswith(b"0\r\n\r\n"):  # the chunked stream's last chunk
            break
    sock.close()
    return b"".join(chunks)


def test_reload_is_atomic_and_in_flight_requests_finish_on_their_config(
    emulators: Emulators, gateway: StartGateway
) -> None:
    a, b = emulators.start("vllm"), emulators.start("sglang")
    backends = [backend_entry("a", a, "vllm"), backend_entry("b", b, "sglang")]
    gw = gateway(backends[:1])
    stalled = stalled_stream(gw)
    eventually(lambda: gw.metric("gateway_backend_in_flight", backend="a") >= 1)

    base = yaml.safe_load((gw.log_path.parent / "gateway.yaml").read_text())
    write_config(gw, {**base, "backends": [{**backends[1], "runtime": "tgi"}], "routes": [{"model": 5}]})
    resp = gw.post("/admin/reload")
    assert resp.status_code == 400
    body = resp.json()
    assert assert_openai_error(body)["code"] == "invalid_config"
    assert any(e.startswith("backends.0.runtime") for e in body["errors"])
    assert any(e.startswith("routes.0") for e in body["errors"])
    assert gw.post("/v1/chat/completions", json=CHAT).headers["x-gateway-backend"] == "a"  # old one serves

    write_config(gw, {**base, "backends": backends[1:], "routes": [{"model": "moe", "backends": ["b"]},
                                                                     {"model": "new", "backends": ["b"]}]})
    resp = gw.post("/admin/reload")
    assert resp.status_code == 200, resp.text
    assert resp.json()["generation"] == 2
    assert {m["id"] for m in gw.get("/v1/models").json()["data"]} == {"moe", "new"}
    assert gw.post("/v1/chat/completions", json=CHAT).headers["x-gateway-backend"] == "b"
    assert [x["name"] for x in gw.get("/admin/backends").json()["backends"]] == ["b"]
    workers = gw.get("/admin/workers").json()  # one process: the supervisor's document, its one row
    assert workers["generation"] == 2
    assert [(r["ready"], r["generation"]) for r in workers["workers"]] == [(True, 2)]

    raw = read_to_end(stalled)  # the stream that started on generation 1 now runs to its end there
    assert b"x-gateway-backend: a" in raw.lower()
    assert b"data: [DONE]" in raw
    assert b'"error"' not in raw
    eventually(lambda: gw.metric("gateway_requests_total", backend="a", status="200") == 2)  # none lost


def test_sighup_reloads_and_a_bad_config_keeps_the_old_one(emulators: Emulators, gateway: StartGateway) -> None:
    a = emulators.start("vllm")
    gw = gateway([backend_entry("a", a, "vllm")])
    base = yaml.safe_load((gw.log_path.parent / "gateway.yaml").read_text())
    write_config(gw, {**base, "retries": {"max_attempts": 0}})
    os.kill(gw.proc.pid, signal.SIGHUP)
    eventually(lambda: "retries.max_attempts" in gw.log_path.read_text())
    assert gw.post("/v1/chat/completions", json=CHAT).status_code == 200
    write_config(gw, {**base, "routes": [{"model": "renamed", "backends": ["a"]}]})
    os.kill(gw.proc.pid, signal.SIGHUP)
    eventually(lambda: [m["id"] for m in gw.get("/v1/models").json()["data"]] == ["renamed"])
    assert gw.proc.poll() is None


def test_sigterm_drains_in_flight_streams_then_exits_zero(emulators: Emulators, gateway: StartGateway) -> None:
    gw = gateway([backend_entry("a", emulators.start("vllm"), "vllm")], limits={"drain_timeout_s": 30})
    host, port = address(gw)
    stalled = stalled_stream(gw)
    eventually(lambda: gw.metric("gateway_backend_in_flight", backend="a") >= 1)
    os.killpg(gw.proc.pid, signal.SIGTERM)

    def refused() -> bool:
        try:
            socket.create_connection((host, port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        return False

    eventually(refused)  # the listening socket is closed at once...
    assert gw.proc.poll() is None  # ...while the in-flight stream keeps the process draining
    raw = read_to_end(stalled)
    assert b"data: [DONE]" in raw
    assert b'"error"' not in raw
    assert gw.proc.wait(30) == 0


def test_every_request_and_token_is_accounted_for_exactly_once(emulators: Emulators, gateway: StartGateway) -> None:
    fleet = [
        backend_entry("flaky", emulators.start("vllm", fail_rate=0.3, fail_status=503), "vllm"),
        backend_entry("erroring", emulators.start("trtllm", fail_rate=0.2, fail_status=500), "trtllm"),
        backend_entry("dying", emulators.start("sglang", die_after_tokens=3), "sglang"),
        backend_entry("ok", emulators.start("vllm"), "vllm"),
    ]
    gw = gateway(fleet, health={"interval_s": 0.2, "failure_threshold": 1000, "cooldown_s": 0.5})
    statuses: Counter[str] = Counter()
    tokens: Counter[tuple[str, str]] = Counter()  # (backend, kind) -> tokens the clients were told
    n = 80
    with httpx.Client(timeout=30) as client:
        for i in range(n):
            stream = i % 2 == 0
            body: dict[str, Any] = {**CHAT, "max_tokens": 6, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            if i % 10 == 9:
                body["model"] = "nope"  # unroutable requests count too
            with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as resp:
                raw = resp.read()
            if resp.status_code != 200:
                assert_openai_error(httpx.Response(400, content=raw).json())
                statuses[str(resp.status_code)] += 1
                continue
            if not stream:
                usage = httpx.Response(200, content=raw).json()["usage"]
            else:
                events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: {")]
                if any('"error"' in e for e in events):
                    statuses["stream_error"] += 1
                    continue
                usage = httpx.Response(200, content=events[-1]).json()["usage"]
            statuses["200"] += 1
            backend = resp.headers["x-gateway-backend"]
            tokens[backend, "prompt"] += usage["prompt_tokens"]
            tokens[backend, "completion"] += usage["completion_tokens"]
    assert sum(statuses.values()) == n
    assert statuses["200"] > n // 3
    assert statuses["404"] == n // 10
    assert statuses["stream_error"] > 0
    assert gw.metric("gateway_requests_total") == n
    for status, count in statuses.items():
        assert gw.metric("gateway_requests_total", status=status) == count, status
    for b in ("flaky", "erroring", "ok"):  # their failures carry no usage: exact equality
        for kind in ("prompt", "completion"):
            assert gw.metric("gateway_tokens_total", backend=b, kind=kind) == tokens[b, kind], (b, kind)
    # "dying" also reports the partial usage of the streams it broke, on top of its successes
    assert gw.metric("gateway_tokens_total", backend="dying", kind="prompt") >= tokens["dying", "prompt"]


def test_soak_smoke(tmp_path: Path) -> None:
    """`python -m bench soak` end to end, for a few seconds: the report exists and accounts for every request."""
    out = tmp_path / "soak.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "soak", "--minutes", "0.1", "--concurrency", "4", "--sample-s", "1",
         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert "| every request counted once by the gateway | yes |" in text
    assert (tmp_path / "soak-rss.png").stat().st_size > 1000


def test_rss_slope_is_least_squares() -> None:
    from bench.soak import slope_mib_per_hour

    assert slope_mib_per_hour([(0.0, 10.0), (3600.0, 12.0), (7200.0, 14.0)]) == pytest.approx(2.0)
    assert slope_mib_per_hour([(0.0, 10.0)]) == 0.0
