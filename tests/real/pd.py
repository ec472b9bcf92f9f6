"""A real prefill/decode pair: two vLLM servers sharing KV through vLLM's `ExampleConnector`.

`ExampleConnector` (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py) writes every
prompt's KV to `<shared_storage_path>/<hash of the prompt's token ids>/<layer>.safetensors` and, for
a new request, loads it when that folder exists. Both servers run `kv_role: kv_both` on one folder,
so the prefill leg stores and the decode leg finds and loads. What it means for the tests:

* only whole 128-token blocks move: a prompt of L tokens is stored as its first (L-1)//128*128
  tokens and looked up (and loaded) as its first (L-2)//128*128 (`align_to_block_size`), so a prompt
  under 130 tokens never transfers anything; `loaded_tokens(L)` is that figure;
* the folder is keyed by the prompt's content only: a prompt any earlier request used (on either
  server, prefill or not) is served from storage, so every test uses a prompt of its own (`nonce`);
* the connector keeps no per-request state: the prefill's answer carries `kv_transfer_params: null`
  and the decode leg needs none;
* the decode server reports what it loaded as `vllm:prompt_tokens_by_source_total{source=
  "external_kv_transfer"}` and `vllm:external_prefix_cache_hits_total`, and logs
  "External Cache Hit!" and "Inject KV cache of N tokens to the paged memory".

Both servers start at once (`launch`), each in its own process group, and are stopped by pid.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .harness import KV_BLOCK_SIZE, ServerProcess, free_port, vllm_argv, vllm_env

CONNECTOR = "ExampleConnector"
INJECT_LINE = re.compile(r"Inject KV cache of (\d+) tokens to the paged memory")
HIT_LINE = "External Cache Hit!"


def kv_transfer_config(storage: Path) -> dict[str, object]:
    """`--kv-transfer-config` of both servers: store and load, in one shared folder."""
    return {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def loaded_tokens(prompt_tokens: int) -> int:
    """How many prompt tokens the decode leg loads from storage (ExampleConnector's block alignment)."""
    return max(0, (prompt_tokens - 2) // KV_BLOCK_SIZE * KV_BLOCK_SIZE)


def nonce() -> str:
    """A token of text no other request has used: keeps a prompt out of every other test's storage."""
    return uuid.uuid4().hex


def stored_prompts(storage: Path) -> dict[str, list[str]]:
    """The shared folder's content: one folder per stored prompt, one safetensors file per layer."""
    if not storage.is_dir():
        return {}
    return {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(storage.iterdir()) if d.is_dir()}


@dataclass(frozen=True)
class SourceCounts:
    """A server's prompt tokens by where their KV came from (vLLM's `prompt_tokens_by_source`)."""

    local_compute: float
    local_cache_hit: float
    external_kv_transfer: float
    external_hits: float  # vllm:external_prefix_cache_hits_total

    def minus(self, before: SourceCounts) -> SourceCounts:
        return SourceCounts(
            self.local_compute - before.local_compute,
            self.local_cache_hit - before.local_cache_hit,
            self.external_kv_transfer - before.external_kv_transfer,
            self.external_hits - before.external_hits,
        )


def source_counts(url: str) -> SourceCounts:
    """Read from a vLLM server's /metrics (`url`: its base URL)."""
    resp = httpx.get(f"{url}/metrics", timeout=10.0)
    resp.raise_for_status()
    by_source: dict[str, float] = {}
    hits = 0.0
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                by_source[sample.labels["source"]] = sample.value
            elif sample.name == "vllm:external_prefix_cache_hits_total":
                hits = sample.value
    return SourceCounts(
        by_source.get("local_compute", 0.0),
        by_source.get("local_cache_hit", 0.0),
        by_source.get("external_kv_transfer", 0.0),
        hits,
    )


@dataclass
class PdPair:
    """The prefill and decode servers and their shared folder."""

    prefill: ServerProcess
    decode: ServerProcess
    storage: Path

    @classmethod
    def launch(cls, workdir: Path, *extra: str) -> PdPair:
        """Start both servers (not waiting for them): ports from the tier's allocator, logs in `workdir`."""
        storage = workdir / "kv-shared"
        storage.mkdir(parents=True, exist_ok=True)
        flag = ["--kv-transfer-config", json.dumps(kv_transfer_config(storage))]
        servers = []
        for role in ("prefill", "decode"):
            port = free_port()
            rundir = workdir / role
            rundir.mkdir(exist_ok=True)
            servers.append(ServerProcess.start(
                f"vLLM {role}", vllm_argv(port, *flag, *extra), port=port,
                log_path=workdir / f"vllm-{role}.log", env=vllm_env(), cwd=rundir,
            ))  # fmt: skip
        return cls(servers[0], servers[1], storage)

    def wait_ready(self, timeout_s: float) -> float:
        """Wait for both servers' /health; returns seconds waited (fails with the log tail)."""
        t0 = time.monotonic()
        for server in (self.prefill, self.decode):
            server.wait_until_ok("/health", max(1.0, timeout_s - (time.monotonic() - t0)))
        waited = time.monotonic() - t0
        print(f"[real] P/D pair ready ({self.prefill.url}, {self.decode.url}) after {waited:.1f} s more",
              file=sys.stderr)
        return waited

    def stop(self) -> None:
        for server in (self.prefill, self.decode):
            server.stop()

    def log(self, server: ServerProcess) -> str:
        return server.log_path.read_text(encoding="utf-8", errors="replace")
