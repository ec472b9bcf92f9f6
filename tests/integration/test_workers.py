"""`gateway serve --workers N`: N processes share one port (SO_REUSEPORT) and stop together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import yaml

from .harness import ROOT, Emulators, backend_entry, eventually


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_workers_share_the_port_and_stop_together(emulators: Emulators, tmp_path: Path) -> None:
    emu = emulators.start("vllm")
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"backends": [backend_entry("v", emu, "vllm")],
                                      "routes": [{"model": "moe", "backends": ["v"]}]}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--host", "127.0.0.1", "--port", "0",
         "--workers", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("gateway listening on "), line
        assert "(2 workers)" in line
        url = line.split()[3]
        children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert len(children) == 2
        with openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
            for _ in range(20):  # new connections each time: the kernel spreads them over the workers
                reply = client.with_options(timeout=10).chat.completions.create(
                    model="moe", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                assert reply.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        eventually(lambda: not _group_alive(proc.pid), timeout=10)  # no worker outlives the supervisor
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()
