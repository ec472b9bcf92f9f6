"""`--peers`: the same non-streaming wrk load against other gateways installed from PyPI.

Each peer gets its own venv under ~/.cache/igw/peers/<name> (installed once, pip with a time limit);
a failed install or a peer that does not come up is skipped with a note, never fatal. CPU is summed
over the peer's whole process group (some peers fork workers).
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench import procs, wrk
from bench.procs import Nginx, Proc

PEERS_DIR = Path.home() / ".cache" / "igw" / "peers"
INSTALL_TIMEOUT_S = 420


@dataclass(frozen=True, slots=True)
class Peer:
    name: str
    requirement: str
    argv: Callable[[Path, str, int, Path], list[str]]  # (venv, upstream url, port, tmp) -> command
    env: tuple[tuple[str, str], ...] = ()


def _litellm_argv(venv: Path, upstream: str, port: int, tmp: Path) -> list[str]:
    config = tmp / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: moe\n    litellm_params:\n      model: hosted_vllm/tiny-moe\n"
        f"      api_base: {upstream}/v1\n      api_key: unused\n"
    )
    return [str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]


PEERS = (
    Peer("sglang-router", "sglang-router", lambda v, u, p, t: [
        str(v / "bin" / "python"), "-m", "sglang_router.launch_router", "--worker-urls", u, "--host", "127.0.0.1",
        "--port", str(p), "--policy", "round_robin"]),
    Peer("vllm-router", "vllm-router", lambda v, u, p, t: [
        str(v / "bin" / "vllm-router"), "--worker-urls", u, "--host", "127.0.0.1", "--port", str(p),
        "--policy", "round_robin"]),
    # Without a master key recent LiteLLM refuses to start unless told this is local use (it is).
    Peer("litellm", "litellm[proxy]", _litellm_argv,
         env=(("LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY", "true"), ("LITELLM_LOG", "ERROR"))),
)


def _install(peer: Peer) -> str | None:
    """Returns None when installed, else why not."""
    venv = PEERS_DIR / peer.name
    stamp = venv / ".bench-installed"
    if stamp.exists():
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
    stamp.touch()
    return None


def _group_cpu(pgid: int) -> float:
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    total += procs.cpu_seconds(int(entry))
            except (OSError, ValueError):
                continue
    return total


def _ready(proc: Proc, url: str, body: bytes, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            return f"exited with {proc.proc.returncode}"
        try:
            req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200 and b"choices" in resp.read():
                    return None
        except Exception as exc:  # any failure means "not yet"
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(1)
    return last


def measure(*, nginx: Nginx, tmp: Path, body: Path, script: Path, plan_runs: int, duration_s: float,
            gateway: Any, naive: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """wrk at c=64 and c=256 against each peer that comes up, with the gateway and the naive proxy
    measured again in the same repetitions for side-by-side ratios."""
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for peer in PEERS:
        why = _install(peer)
        if why is not None:
            notes.append(f"peer {peer.name} skipped: {why}")
            continue
        port = procs.free_port()
        argv = peer.argv(PEERS_DIR / peer.name, nginx.json_url, port, tmp)
        proc = Proc(peer.name, argv, log=tmp / f"peer-{peer.name}.log", env=dict(peer.env))
        try:
            url = f"http://127.0.0.1:{port}"
            why = _ready(proc, url, body.read_bytes(), 90)
            if why is not None:
                tail = (tmp / f"peer-{peer.name}.log").read_text(errors="replace")[-300:]
                notes.append(f"peer {peer.name} skipped: did not answer a chat completion ({why}); log: {tail!r}")
                continue
            notes.append(f"peer {peer.name} {version(peer.requirement.split('[')[0])}: `{' '.join(argv)}`"
                         .replace(str(PEERS_DIR), "~/.cache/igw/peers"))
            pgid = proc.pid
            for rep in range(plan_runs):
                for c in (64, 256):
                    for name, target_url, cpu in ((peer.name, url, lambda g=pgid: _group_cpu(g)),
                                                  ("gateway", gateway.url, gateway.cpu),
                                                  ("naive", naive.url, naive.cpu)):
                        cpu0 = cpu()
                        try:
                            r = wrk.run(target_url + "/v1/chat/completions", body, script, connections=c,
                                        duration_s=duration_s)
                        except RuntimeError as exc:
                            notes.append(f"{name} at c={c}: {exc}")
                            continue
                        used = cpu() - cpu0
                        rows.append({"target": name, "c": c, "rep": rep, "rps": r.rps, "p50_ms": r.p50_ms,
                                     "p99_ms": r.p99_ms, "errors": r.errors, "requests": r.requests,
                                     "cpu_us_per_req": used / r.requests * 1e6 if r.requests else None,
                                     "peer_group": peer.name})
        finally:
            proc.stop()
    return rows, notes


def version(peer: str) -> str:
    venv = PEERS_DIR / peer
    try:
        out = subprocess.run([str(venv / "bin" / "pip"), "list", "--format", "json"], capture_output=True,
                             timeout=30, check=False)
        pkgs = {p["name"].lower(): p["version"] for p in orjson.loads(out.stdout)}
    except (OSError, subprocess.SubprocessError, orjson.JSONDecodeError):
        return "?"
    return str(pkgs.get(peer.lower(), "?"))
