"""Real processes and real sockets for integration tests.

Emulators run on an event loop in a background thread of the test process (real sockets, so the
sync OpenAI client can call them without deadlocking the test); the gateway runs as its own process
started with `python -m gateway serve`, exactly as a user would, and is stopped by its pid.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from backends.base import Runtime
from backends.emulator import DisaggConfig, EmulatorConfig, Faults, KvEventsConfig, RunningEmulator, start_emulator

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
AS_JSON = {"Content-Type": "application/json"}  # what every admin write sends (a body-less POST too)


class LoopThread:
    """An asyncio loop in a daemon thread, for servers that sync test code talks to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class Emulators:
    """Starts emulators on the loop thread and stops them all at the end."""

    def __init__(self, loop: LoopThread) -> None:
        self._loop = loop
        self._running: list[RunningEmulator] = []

    def start(
        self, runtime: Runtime | str, *, model: str = "tiny-moe", profile: str = "tiny", speed: float = 50.0,
        kv_events: KvEventsConfig | None = None, block_size: int | None = None, num_kv_blocks: int | None = None,
        host: str = "127.0.0.1", port: int = 0, embedding_dim: int | None = None, seed: int = 0,
        data_parallel_size: int = 1, disagg: DisaggConfig | None = None, **faults: Any,
    ) -> RunningEmulator:
        """`host` may be any loopback address (127.0.0.2, ... reach this host too: discovery tests
        give each emulator its own address, on one port)."""
        cfg = EmulatorConfig(
            runtime=Runtime(runtime), model=model, profile=profile, speed=speed, faults=Faults(**faults),
            kv_events=kv_events, block_size=block_size, num_kv_blocks=num_kv_blocks,
            embedding_dim=embedding_dim, seed=seed, data_parallel_size=data_parallel_size, disagg=disagg,
        )
        emu = self._loop.run(start_emulator(cfg, host=host, port=port))
        self._running.append(emu)
        return emu

    def stop(self, emu: RunningEmulator) -> None:
        self._loop.run(emu.stop())
        self._running.remove(emu)

    def stop_all(self) -> None:
        for emu in list(self._running):
            self.stop(emu)


def backend_entry(name: str, emu: RunningEmulator, runtime: Runtime | str, **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "runtime": str(Runtime(runtime)), "url": emu.url,
                             "model": "tiny-moe", **extra}
    if emu.metrics_url != emu.url:
        entry["metrics_url"] = emu.metrics_url
    return entry


class GatewayProcess:
    """`python -m gateway serve --config FILE --port 0` (without a config: the embedded demo fleet),
    stopped by pid. With `host="0.0.0.0"` it listens on every interface; the tests still reach it on
    127.0.0.1."""

    def __init__(
        self, config: Mapping[str, Any] | None, workdir: Path, *, host: str = "127.0.0.1", workers: int = 1,
        port: int = 0, env: Mapping[str, str] | None = None,
    ) -> None:
        source: list[str] = []
        self._clients: list[openai.OpenAI] = []
        self.config_path = workdir / "gateway.yaml"
        if config is not None:
            self.config_path.write_text(yaml.safe_dump(dict(config)))
            source = ["--config", str(self.config_path)]
        self.log_path = workdir / "gateway.log"
        self._log = self.log_path.open("a")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", *source, "--host", host, "--port", str(port),
             "--workers", str(workers)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the gateway prints its URL once it is listening
        if not line.startswith("gateway listening on "):
            self.stop()
            raise RuntimeError(f"gateway did not start: {line!r}\n{self.log_path.read_text()}")
        # "gateway listening on URL" [+ " (N workers)"]
        self.url = line.split()[3].replace("://0.0.0.0:", "://127.0.0.1:")
        self.picker_port: int | None = None  # the Endpoint Picker's port, when the config has one
        if config is not None and config.get("endpoint_picker") is not None:
            while not line.startswith("endpoint picker"):  # "endpoint picker (...) on HOST:PORT", after the URL
                line = self.proc.stdout.readline()
                if not line:
                    self.stop()
                    raise RuntimeError(f"gateway did not start its picker\n{self.log_path.read_text()}")
            self.picker_port = int(line.rsplit(":", 1)[1])

    def client(self) -> openai.OpenAI:
        """An official SDK client for this gateway (no SDK retries: we test the gateway's own);
        closed when the gateway stops."""
        c = openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0)
        self._clients.append(c)
        return c

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        """A POST typed `application/json` unless it says otherwise (a body-less one too: admin
        writes require it, as the README's curl examples send it)."""
        if not {"content", "data", "files", "json"} & kwargs.keys():
            headers = dict(kwargs.pop("headers", None) or {})
            if not any(k.lower() == "content-type" for k in headers):
                headers.update(AS_JSON)
            kwargs["headers"] = headers
        return httpx.post(self.url + path, timeout=30, **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 when absent)."""
        total = 0.0
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def stop(self) -> int:
        for c in self._clients:
            c.close()
        stop_group(self.proc, grace_s=10)
        self._log.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


def stop_group(proc: subprocess.Popen[Any], *, grace_s: float) -> None:
    """Stop a child started with `start_new_session=True`, by its process group: SIGTERM, then
    SIGKILL when it is still running after `grace_s`; the leader is reaped either way."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def kill_and_wait_gone(pid: int, *, timeout: float = 15.0) -> None:
    """SIGKILL a gateway worker and wait until it is gone (exited: a zombie or reaped), so its
    listening socket is closed. Until then the kernel may still queue a new connection on it
    (SO_REUSEPORT gives each worker its own accept queue) and reset it when the process dies, as it
    does for any client of a crashing worker unless `net.ipv4.tcp_migrate_req` is 1. A test talks to
    the gateway once the crash has happened, not during it."""
    os.kill(pid, signal.SIGKILL)

    def gone() -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return True
        return stat.rsplit(")", 1)[1].split()[0] in {"Z", "X"}

    eventually(gone, timeout)


def eventually(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    """Poll `condition` until it holds, failing after `timeout` seconds (tests never sleep to
    synchronise: they wait for an observable state)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def wait_for(fetch: Callable[[], T], ok: Callable[[T], bool], *, timeout: float = 15.0, what: str = "a condition") -> T:
    """Call `fetch` until `ok` holds for what it returned, and return that; fail after `timeout`
    seconds showing the last value (for waits that need the observed state, not just a yes)."""
    deadline = time.monotonic() + timeout
    while True:
        got = fetch()
        if ok(got):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {got!r:.2000}")
        time.sleep(0.02)


def iter_lines(response: httpx.Response) -> Iterator[str]:
    yield from response.iter_lines()
