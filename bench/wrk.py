"""Closed-loop load with wrk: fixed connections, POST bodies from a Lua script, a JSON summary from
the script's `done()`, and wrk's own CPU time (from wait4) so we can show it is not the bottleneck."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import orjson

WRK = shutil.which("wrk") or "/usr/bin/wrk"
MARK = "WRKJSON "

LUA = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
wrk.body = f:read("*a")
f:close()

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '%s{"requests":%d,"duration_us":%d,"bytes":%d,"connect":%d,"read":%d,"write":%d,"status":%d,'
    .. '"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}\\n',
    "MARK", summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean,
    latency.max))
end
""".replace("MARK", MARK)


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests: int
    duration_s: float
    bytes: int  # every byte read, the head and the body of unfinished responses included
    errors: int  # connect + read + write + non-2xx/3xx status + timeouts
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    wrk_cpu_s: float  # wrk's own user + system time

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def write_script(tmp: Path) -> Path:
    path = tmp / "post.lua"
    path.write_text(LUA)
    return path


def run(url: str, body_file: Path, script: Path, *, connections: int, duration_s: float,
        threads: int = 1, timeout_s: float = 10.0) -> WrkResult:
    argv = [WRK, "-t", str(min(threads, connections)), "-c", str(connections), "-d", f"{duration_s:g}s",
            "--timeout", f"{timeout_s:g}s", "-s", str(script), url]
    with tempfile.TemporaryFile() as errf:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errf,
                                env={**os.environ, "BENCH_BODY": str(body_file)})
        assert proc.stdout is not None
        out = proc.stdout.read().decode()
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)  # reaps it ourselves, for wrk's own rusage
        errf.seek(0)
        err = errf.read().decode(errors="replace")
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [line for line in out.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {err.strip()} {out[-500:]}")
    d = orjson.loads(lines[-1][len(MARK):])
    return WrkResult(
        requests=d["requests"], duration_s=d["duration_us"] / 1e6, bytes=d["bytes"],
        errors=d["connect"] + d["read"] + d["write"] + d["status"] + d["timeout"],
        p50_ms=d["p50_us"] / 1e3, p90_ms=d["p90_us"] / 1e3, p99_ms=d["p99_us"] / 1e3, mean_ms=d["mean_us"] / 1e3,
        wrk_cpu_s=usage.ru_utime + usage.ru_stime,
    )
