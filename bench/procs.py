"""The processes a benchmark runs (nginx, gateway, Python servers) and what we read about them from /proc.

Every process is started in its own session and stopped by its pid; nothing is killed by name.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = Path(__file__).resolve().parent / "upstream"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_nofile(want: int = 65536) -> int:
    """Raise this process's open-file limit (children inherit it); returns the soft limit reached."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (want, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(target, soft), max(target, hard)))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (every server here runs in a session of its own)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def _task_ns(pid: int) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total


def group_cpu_seconds(pgid: int) -> float:
    """On-CPU time of a whole process group, summed over every thread of every live member from
    /proc/<pid>/task/<tid>/schedstat: nanosecond resolution, where /proc/<pid>/stat counts 10 ms
    ticks (too coarse for a few seconds of a process using a fraction of a core). Threads that
    exited are not counted; `group_cpu_ticks` is the coarse cross-check that does count them."""
    return sum(_task_ns(pid) for pid in _group_pids(pgid)) / 1e9


def group_cpu_ticks(pgid: int) -> float:
    """The same from /proc/<pid>/stat (utime + stime, exited threads included, 1/CLK_TCK s ticks)."""
    total = 0.0
    for pid in _group_pids(pgid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def group_read_calls(pgid: int) -> int:
    """read(2)-family system calls of a process group (`syscr` of /proc/<pid>/io). uvloop (libuv)
    reads sockets with read(2), so for our Python servers this counts socket reads; recv(2), which
    Rust's standard library uses, is not counted."""
    total = 0
    for pid in _group_pids(pgid):
        with contextlib.suppress(OSError, StopIteration, ValueError):
            lines = Path(f"/proc/{pid}/io").read_text().splitlines()
            total += int(next(line for line in lines if line.startswith("syscr:")).split()[1])
    return total


def machine_busy_seconds() -> float:
    """CPU-seconds spent busy by the whole machine (all cores, all processes), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def wait_port(port: int, *, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on port {port} after {timeout_s}s")


class Proc:
    """A child process in its own session, stopped by pid (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, argv: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None,
                 stdout_pipe: bool = False, cwd: Path = ROOT) -> None:
        self.name = name
        self.log_path = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            list(argv), cwd=cwd, stdout=subprocess.PIPE if stdout_pipe else self._log, stderr=self._log,
            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read_line(self, prefix: str) -> str:
        """The first stdout line (a server announcing where it listens); raises if it is not `prefix...`."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(prefix):
            self.stop()
            raise RuntimeError(f"{self.name} did not start: {line!r}\n{self.log_path.read_text()[-3000:]}")
        return line.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class Nginx:
    """nginx with one worker: canned chat JSON on `json_url`, canned SSE stream on `sse_url`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp / "nginx"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.json_port, self.sse_port = free_port(), free_port()
        conf = (UPSTREAM / "nginx.conf").read_text()
        for key, value in {"@ROOT@": str(UPSTREAM), "@TMP@": str(self.tmp),
                           "@JSON_PORT@": str(self.json_port), "@SSE_PORT@": str(self.sse_port)}.items():
            conf = conf.replace(key, value)
        path = self.tmp / "nginx.conf"
        path.write_text(conf)
        self.proc = Proc("nginx", [NGINX, "-c", str(path), "-p", str(self.tmp)], log=self.tmp / "stderr.log")
        wait_port(self.json_port)
        wait_port(self.sse_port)

    @property
    def json_url(self) -> str:
        return f"http://127.0.0.1:{self.json_port}"

    @property
    def sse_url(self) -> str:
        return f"http://127.0.0.1:{self.sse_port}"

    def worker_pids(self) -> list[int]:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in children.read_text().split()] if children.exists() else []

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(p) for p in [self.proc.pid, *self.worker_pids()])

    def stop(self) -> None:
        self.proc.stop()


def gateway_config(upstream_url: str, *, model: str = "moe") -> dict[str, Any]:
    """One vLLM backend behind one route with `policy: round_robin`, the load issue 13 measures (the
    peers run round robin too)."""
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"name": "nginx-vllm", "runtime": "vllm", "url": upstream_url, "model": "tiny-moe"}],
        "routes": [{"model": model, "backends": ["nginx-vllm"], "policy": "round_robin"}],
        "health": {"interval_s": 5},
    }


def pure_sources(tmp: Path) -> Path | None:
    """A copy of the gateway's sources without the modules `make native` compiled (None when nothing
    is compiled: the gateway already runs as pure Python)."""
    from gateway import build_check

    if not build_check.compiled():
        return None
    dest = tmp / "pure-sources"
    for package in ("gateway", "backends"):
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("*.so", "__pycache__"),
                        dirs_exist_ok=True)
    return dest


def baseline_sources(rev: str, tmp: Path) -> tuple[Path, str]:
    """The gateway's packages at commit `rev` (`git archive`), compiled like the current tree when the
    current tree is compiled (mypyc, a few minutes): the "previous commit" measured side by side.
    Returns the folder and the commit's short hash; raises RuntimeError when it cannot be made."""
    from gateway import build_check

    short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True)
    if short.returncode:
        raise RuntimeError(f"no commit {rev!r}: {short.stderr.strip()}")
    dest = tmp / f"baseline-{short.stdout.strip()}"
    dest.mkdir()
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    if build_check.compiled():
        log = tmp / "baseline-build.log"
        with log.open("wb") as out:
            built = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=dest, stdout=out,
                                   stderr=subprocess.STDOUT, env={**os.environ, "GATEWAY_NATIVE": "1"})
        if built.returncode:
            raise RuntimeError(f"the native build of {rev} failed (log: {log})")
    return dest, short.stdout.strip()


class Gateway:
    """`python -m gateway serve` with one vLLM backend, exactly as a user runs it (from `sources`, a
    copy of the gateway's packages, when given)."""

    def __init__(self, name: str, upstream_url: str, tmp: Path, *, sources: Path | None = None,
                 tracing: dict[str, Any] | None = None, workers: int = 1) -> None:
        self.name = name
        config = tmp / f"{name}.yaml"
        config.write_text(yaml.safe_dump(gateway_config(upstream_url) | ({"tracing": tracing} if tracing else {})))
        self.config_path = config
        self.proc = Proc(name, [sys.executable, "-m", "gateway", "serve", "--config", str(config),
                                "--log-level", "WARNING", *(["--workers", str(workers)] if workers > 1 else [])],
                         log=tmp / f"{name}.log", stdout_pipe=True,
                         cwd=sources or ROOT, env={"PYTHONPATH": str(sources)} if sources else None)
        # `gateway listening on URL`, or with --workers `gateway listening on URL (N workers)`
        self.url = self.proc.read_line("gateway listening on ").split()[3]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.stop()


class PyServer:
    """One of our small Python servers (`python -m bench.<module> ...`) that prints `listening on URL`."""

    def __init__(self, name: str, module: str, args: Sequence[str], tmp: Path) -> None:
        self.name = name
        self.proc = Proc(name, [sys.executable, "-m", module, *args], log=tmp / f"{name}.log", stdout_pipe=True)
        self.url = self.proc.read_line("listening on ").split()[-1]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.stop()
