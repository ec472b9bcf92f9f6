"""`--peers`: other gateways, installed from PyPI at pinned versions, run in front of the same upstreams.

Each peer gets its own venv under ~/.cache/igw/peers/<name>, installed once (pip with a time limit)
and reinstalled when its pin changes (the venv's `.bench-installed` holds the requirement it was
made for). A failed install or a peer that does not answer is skipped with a note, never fatal.
Every peer runs with one worker URL, round robin, request logging off (warning level, as the
gateway runs) and its Prometheus exporter on a free port, so that several instances can run at once.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench import procs
from bench.procs import Proc

PEERS_DIR = Path.home() / ".cache" / "igw" / "peers"
INSTALL_TIMEOUT_S = 420
READY_TIMEOUT_S = 180  # LiteLLM takes ~45 s to start on a busy 2-core machine


@dataclass(frozen=True, slots=True)
class Peer:
    name: str
    package: str  # the distribution whose version the report states
    requirement: str  # what pip installs: pinned
    argv: Callable[[Path, str, int, Path], list[str]]  # (venv, upstream url, port, tmp) -> command
    env: tuple[tuple[str, str], ...] = ()


def _sglang_argv(venv: Path, upstream: str, port: int, tmp: Path) -> list[str]:
    return [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", "--worker-urls", upstream,
            "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--prometheus-port", str(procs.free_port()), "--log-level", "warn"]


def _vllm_argv(venv: Path, upstream: str, port: int, tmp: Path) -> list[str]:
    return [str(venv / "bin" / "vllm-router"), "--worker-urls", upstream, "--host", "127.0.0.1",
            "--port", str(port), "--policy", "round_robin", "--prometheus-port", str(procs.free_port()),
            "--log-level", "warning"]


def _smg_argv(venv: Path, upstream: str, port: int, tmp: Path) -> list[str]:
    # SMG (the Shepherd Model Gateway, SGLang's router's successor) routes by the request's model,
    # which it learns from the worker's /v1/models: the bench's clients ask for `moe`, served as
    # `tiny-moe` (the gateway's config renames it the same way). Round robin, as the others.
    return [str(venv / "bin" / "smg"), "launch", "--worker-urls", upstream, "--host", "127.0.0.1",
            "--port", str(port), "--policy", "round_robin", "--model-alias", "moe=tiny-moe",
            "--prometheus-port", str(procs.free_port()), "--log-level", "warn"]


def _litellm_argv(venv: Path, upstream: str, port: int, tmp: Path) -> list[str]:
    config = tmp / f"litellm-{port}.yaml"
    config.write_text(
        "model_list:\n  - model_name: moe\n    litellm_params:\n      model: hosted_vllm/tiny-moe\n"
        f"      api_base: {upstream}/v1\n      api_key: unused\n"
    )
    return [str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]


VLLM_ROUTER = Peer("vllm-router", "vllm-router", "vllm-router==0.1.17", _vllm_argv)
SGLANG_ROUTER = Peer("sglang-router", "sglang-router", "sglang-router==0.3.2", _sglang_argv)
SMG = Peer("smg", "smg", "smg==1.13.0", _smg_argv)
# ~100x the routers' CPU per request: only with `--litellm`. Pinned to what pip resolves
# `litellm[proxy]` to here (1.110's proxy extra needs `litellm-proxy`, which PyPI does not have).
# Without a master key recent LiteLLM refuses to start unless told this is local use (it is).
LITELLM = Peer("litellm", "litellm", "litellm[proxy]==1.108.7", _litellm_argv,
               env=(("LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY", "true"), ("LITELLM_LOG", "ERROR")))


def install(peer: Peer) -> str | None:
    """Installs the pinned peer if its venv does not hold it yet. Returns None when installed, else why not."""
    venv = PEERS_DIR / peer.name
    stamp = venv / ".bench-installed"
    if stamp.exists() and stamp.read_text().strip() == peer.requirement:
        return None
    try:
        PEERS_DIR.mkdir(parents=True, exist_ok=True)
        if not (venv / "bin" / "python").exists():
            subprocess.run(["python3", "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
        out = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", peer.requirement], capture_output=True,
                             text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"install failed: {exc}"
    if out.returncode != 0:
        return f"pip install {peer.requirement} failed: {out.stderr.strip().splitlines()[-1:]}"
    stamp.write_text(peer.requirement + "\n")
    return None


def version(peer: Peer) -> str:
    """The installed version of the peer's package, from its venv (`?` when unknown)."""
    try:
        out = subprocess.run([str(PEERS_DIR / peer.name / "bin" / "pip"), "list", "--format", "json"],
                             capture_output=True, timeout=60, check=False)
        pkgs = {p["name"].lower(): p["version"] for p in orjson.loads(out.stdout)}
    except (OSError, subprocess.SubprocessError, orjson.JSONDecodeError):
        return "?"
    return str(pkgs.get(peer.package.lower(), "?"))


@dataclass(slots=True)
class Running:
    peer: Peer
    proc: Proc
    url: str
    command: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.stop()


def start(peer: Peer, upstream: str, tmp: Path, label: str) -> Running:
    """Starts the (installed) peer in front of `upstream`; `wait_ready` says when it answers."""
    port = procs.free_port()
    argv = peer.argv(PEERS_DIR / peer.name, upstream, port, tmp)
    proc = Proc(label, argv, log=tmp / f"{label}.log", env=dict(peer.env))
    return Running(peer, proc, f"http://127.0.0.1:{port}", " ".join(argv).replace(str(PEERS_DIR), "~/.cache/igw/peers"))


def wait_ready(running: Running, body: bytes, *, timeout_s: float = READY_TIMEOUT_S) -> str | None:
    """Polls with a real chat completion until the peer answers 200 with a completion (None), or says
    why not (exited, or the last error when `timeout_s` is up)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if running.proc.proc.poll() is not None:
            return f"exited with {running.proc.proc.returncode}"
        try:
            req = urllib.request.Request(running.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200 and b"choices" in resp.read():
                    return None
        except Exception as exc:  # any failure means "not yet"
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    return last


def log_tail(running: Running, n: int = 300) -> str:
    return running.proc.log_path.read_text(errors="replace")[-n:]
