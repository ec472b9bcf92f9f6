"""Processes for the real-vLLM tier: the vLLM server and the gateway, each in its own process group.

Stopped by process group id (SIGTERM, then SIGKILL after a grace period), so vLLM's engine-core
worker goes with its API server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = ROOT / "scripts" / "real_vllm" / "setup_env.sh"
CACHE = Path(os.environ.get("IGW_CACHE") or Path.home() / ".cache" / "igw")
VLLM_PYTHON = CACHE / "vllm-venv" / "bin" / "python"
MODEL_DIR = CACHE / "tiny-moe"

SERVED_MODEL = "tiny-moe"  # the name vLLM serves
ROUTE_MODEL = "moe-chat"  # the name clients use at the gateway
BACKEND_NAME = "vllm-real"
MAX_MODEL_LEN = 2048
KV_BLOCK_SIZE = 128  # vLLM's block size on CPU

# Three servers boot at once when the P/D tests run (tests/real/conftest.py): 270 s to the last
# /health on the 2-core machine under a load of 14 (one alone: 30-180 s).
VLLM_STARTUP_TIMEOUT_S = float(os.environ.get("IGW_VLLM_STARTUP_TIMEOUT", "600"))
GATEWAY_STARTUP_TIMEOUT_S = 60.0
SETUP_TIMEOUT_S = 480.0  # cold: ~110 s (pip ~100 s, model ~5 s)
POLL_INTERVAL_S = 0.5
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class KvEndpoints:
    """Where a vLLM server's KV-event publisher connects (the gateway binds it) and its replay socket."""

    endpoint: str
    replay: str

    @classmethod
    def fresh(cls) -> KvEndpoints:
        return cls(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")

    def vllm_flag(self) -> list[str]:
        """`--kv-events-config`: vLLM connects its PUB to `endpoint` and binds its replay ROUTER."""
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                  "replay_endpoint": self.replay, "topic": "kv"}
        return ["--kv-events-config", json.dumps(config)]

    def gateway_entry(self) -> dict[str, object]:
        return {"endpoint": self.endpoint, "bind": True, "replay_endpoint": self.replay, "topic": "kv"}


def vllm_argv(port: int, *extra: str) -> list[str]:
    """The real tier's vLLM command line (served as SERVED_MODEL, prefix caching and its usage on)."""
    return [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(MODEL_DIR),
        "--served-model-name", SERVED_MODEL,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--host", "127.0.0.1",
        "--port", str(port),
        *extra,
    ]  # fmt: skip


def vllm_env() -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")},
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class ServerProcess:
    """A server subprocess in its own process group, with its output in a log file."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls, name: str, argv: list[str], *, port: int, log_path: Path, env: dict[str, str], cwd: Path
    ) -> ServerProcess:
        with log_path.open("wb") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,  # own process group: stop() kills vLLM's workers too
            )
        return cls(name, proc, port, log_path)

    def wait_until_ok(self, path: str, timeout_s: float) -> float:
        """Poll GET `path` until 200; returns seconds waited. Fails with the log tail on death/timeout."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        last = "no answer yet"
        with httpx.Client(timeout=5.0) as http:
            while True:
                code = self.proc.poll()
                if code is not None:
                    self.stop()
                    pytest.fail(
                        f"{self.name} exited with code {code} before {path} was ready; "
                        f"log tail ({self.log_path}):\n{log_tail(self.log_path)}",
                        pytrace=False,
                    )
                try:
                    resp = http.get(self.url + path)
                    if resp.status_code == 200:
                        return time.monotonic() - t0
                    last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                except httpx.HTTPError as exc:
                    last = repr(exc)
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(
                        f"{self.name} not ready at {self.url}{path} after {timeout_s:.0f} s (last: {last}); "
                        f"log tail ({self.log_path}):\n{log_tail(self.log_path)}",
                        pytrace=False,
                    )
                time.sleep(POLL_INTERVAL_S)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after a grace period, and reap the leader."""
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        if self.proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                self.proc.wait(timeout=STOP_GRACE_S)
        # Workers that outlived their leader (vLLM's engine core) go too.
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ensure_vllm_env() -> None:
    """Run setup_env.sh (a quick no-op when the venv and model are ready)."""
    t0 = time.monotonic()
    result = subprocess.run(
        ["bash", str(SETUP_SCRIPT)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env={**os.environ, "IGW_CACHE": str(CACHE)},
        timeout=SETUP_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(
            f"{SETUP_SCRIPT} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}",
            pytrace=False,
        )
    print(f"\n[real] setup_env.sh took {time.monotonic() - t0:.1f} s", file=sys.stderr)
