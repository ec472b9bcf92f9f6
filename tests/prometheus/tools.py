"""Real Prometheus for the tests: finding the binaries, and one Prometheus process on loopback.

The binaries come from `scripts/prometheus/fetch.sh` (Debian's package, unpacked into the cache;
`make test` runs it). Without them the tier fails under CI and is skipped elsewhere, saying how to
get them.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from tests.integration.harness import stop_group

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
FETCH = ROOT / "scripts" / "prometheus" / "fetch.sh"
T = TypeVar("T")


def binaries() -> Path:
    """The directory holding `prometheus` and `promtool` (fetched once into the cache)."""
    done = subprocess.run(["bash", str(FETCH)], capture_output=True, text=True, timeout=300, check=False)
    found = Path(done.stdout.strip()) if done.returncode == 0 else None
    if found is None or not (found / "prometheus").exists():
        message = (f"no Prometheus binaries ({FETCH.relative_to(ROOT)} said: {done.stderr.strip()!r}); "
                   "`make test` fetches them")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def until(condition: Callable[[], T | None], *, timeout: float, what: str) -> T:
    """Poll `condition` until it returns something other than None/False; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got is not None and got is not False:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


class PromQLError(AssertionError):
    pass


class Prometheus:
    """`prometheus` with deploy/prometheus/prometheus.yml, its scrape target and intervals replaced:
    loopback only, storage in `workdir`, stopped by pid."""

    def __init__(self, bin_dir: Path, workdir: Path, *, target: str, interval_s: int = 1) -> None:
        config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
        config["global"]["scrape_interval"] = f"{interval_s}s"
        config["global"]["evaluation_interval"] = f"{interval_s}s"
        config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
        (job,) = config["scrape_configs"]
        job["static_configs"][0]["targets"] = [target]
        self.job: str = job["job_name"]
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [str(bin_dir / "prometheus"), f"--config.file={path}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self._http = httpx.Client(base_url=self.url, timeout=10)
        until(self._ready, timeout=30, what=f"Prometheus to be ready (log: {self.log_path})")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.log_path.read_text()}")
        try:
            return self._http.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns `data`, raising PromQLError on an error reply."""
        reply = self._http.get(f"/api/v1/{path}", params=params)
        body = reply.json()
        if reply.status_code != 200 or body.get("status") != "success":
            raise PromQLError(f"{path} {params}: {reply.status_code} {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, *, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's vector (or a scalar as a one-sample vector)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def values(self, expr: str, *, by: str, at: float | None = None) -> dict[str, float]:
        """{value of label `by`: sample value} of an instant query."""
        return {s["metric"].get(by, ""): float(s["value"][1]) for s in self.query(expr, at=at)}

    def scalar(self, expr: str, *, at: float | None = None) -> float | None:
        result = self.query(expr, at=at)
        assert len(result) <= 1, f"{expr}: {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self._http.close()
        stop_group(self.proc, grace_s=15)
        self._log.close()


def finite(samples: list[dict[str, Any]]) -> list[float]:
    return [v for v in (float(s["value"][1]) for s in samples) if math.isfinite(v)]


def rule_groups(name: str) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load((PROMETHEUS_DIR / "rules" / name).read_text())["groups"]
    return groups


def label_matchers(labels: Mapping[str, str]) -> str:
    return ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))


def unix_time(rfc3339: str) -> float:
    """Prometheus's RFC 3339 timestamps (UTC, up to nanoseconds) as Unix seconds."""
    whole, _, fraction = rfc3339.rstrip("Z").partition(".")
    stamp = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.UTC).timestamp()
    return stamp + (float("0." + fraction) if fraction else 0.0)
