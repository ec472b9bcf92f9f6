"""A real gateway (with emulators, via the integration harness) under steady load, for browser tests."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import Emulators, GatewayProcess, LoopThread, backend_entry

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PROFILE = "deepseek-v3-8xh200"


class Load:
    """Streaming chat requests from a few threads until stopped, alternating the plain and the A/B route."""

    def __init__(self, url: str, *, workers: int = 6) -> None:
        self._url = url
        self._stop = threading.Event()
        self.sent = 0
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def _run(self, worker: int) -> None:
        with httpx.Client(base_url=self._url, timeout=30) as c:
            i = 0
            while not self._stop.is_set():
                body = {"model": "ab" if (worker + i) % 2 else "deepseek-v3", "stream": True, "max_tokens": 24 + i % 40,
                        "messages": [{"role": "user", "content": f"worker {worker} request {i} " * (1 + i % 5)}]}
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_bytes():
                        pass
                self.sent += 1
                i += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


@pytest.fixture(scope="module")
def loaded_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: CI must install it (make system-deps)")
        pytest.skip("chromium is not installed (make system-deps, or apt-get install -y chromium)")
    loop = LoopThread()
    emus = Emulators(loop)
    gw: GatewayProcess | None = None
    load: Load | None = None
    try:
        backends = []
        for rt in ("vllm", "sglang", "trtllm", "triton"):
            dp = 2 if rt == "vllm" else 1  # vllm-a is a wide server: two data-parallel ranks
            emu = emus.start(rt, model="ensemble" if rt == "triton" else "deepseek-v3", profile=PROFILE, speed=4.0,
                             data_parallel_size=dp)
            backends.append(backend_entry(f"{rt}-a", emu, rt, usd_per_hour=96.0, data_parallel_size=dp,
                                          model="ensemble" if rt == "triton" else "deepseek-v3"))
        routes = [
            {"model": "deepseek-v3", "backends": [b["name"] for b in backends], "policy": "least_load"},
            {"model": "ab", "split": {"arms": [{"name": "vllm", "weight": 1, "backends": ["vllm-a"]},
                                                {"name": "sglang", "weight": 1, "backends": ["sglang-a"]}]}},
        ]
        workdir = Path(tmp_path_factory.mktemp("browser-gw"))
        gw = GatewayProcess({"backends": backends, "routes": routes, "health": {"interval_s": 0.5}}, workdir)
        load = Load(gw.url)
        yield gw
    finally:
        if load is not None:
            load.stop()
        if gw is not None:
            gw.stop()
        emus.stop_all()
        loop.close()
