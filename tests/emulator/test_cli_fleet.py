"""The CLI in its own process, and the demo fleet in this one."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from backends.base import Runtime
from backends.emulator.cli import build_parser, config_from_args
from backends.emulator.fleet import DEMO_FLEET, start_fleet


@contextlib.asynccontextmanager
async def cli(runtime: str, *flags: str) -> AsyncIterator[tuple[str, str]]:
    """`python -m backends.emulator.cli` in its own process: (its ready line, its URL); on exit it
    gets SIGTERM and must exit 0."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backends.emulator.cli", "--runtime", runtime, "--port", "0", "--model", "m",
        "--profile", "tiny", "--speed", "50", *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        m = re.search(r"ready at (http://\S+)", line)
        assert m, line
        yield line, m.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0


@pytest.mark.parametrize("runtime", ["vllm", "triton"])
async def test_cli_runs_until_sigterm(runtime: str) -> None:
    async with cli(runtime, "--fail-first", "1") as (line, url):
        health = "/v2/health/ready" if runtime == "triton" else "/health"
        async with aiohttp.ClientSession() as s, s.get(url + health) as r:
            assert r.status == 200
        if runtime == "triton":
            assert "metrics=http://" in line


def test_cli_flags_map_to_the_config() -> None:
    args = build_parser().parse_args([
        "--runtime", "sglang", "--port", "0", "--model", "x", "--profile", "mixtral-8x7b-h100", "--speed", "3",
        "--fail-rate", "0.25", "--max-queue", "4", "--die-after-tokens", "7", "--not-ready-for-s", "2", "--hang"])
    cfg = config_from_args(args)
    assert cfg.runtime is Runtime.SGLANG
    assert cfg.profile == "mixtral-8x7b-h100"
    assert cfg.speed == 3.0
    f = cfg.faults
    assert (f.fail_rate, f.max_queue, f.die_after_tokens, f.not_ready_for_s, f.hang) == (0.25, 4, 7, 2.0, True)


async def test_demo_fleet_starts_one_emulator_per_runtime() -> None:
    fleet = await start_fleet(DEMO_FLEET, speed=100.0, host="127.0.0.1")
    try:
        assert {e.runtime for e in fleet} == set(Runtime)
        assert all(e.usd_per_hour == 96.0 for e in fleet)
        triton = next(e for e in fleet if e.runtime is Runtime.TRITON)
        assert triton.metrics_url != triton.url
        async with aiohttp.ClientSession() as s:
            for emu in fleet:
                if emu.runtime is Runtime.TRITON:
                    url, body = emu.url + "/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 2}
                else:
                    url = emu.url + "/v1/chat/completions"
                    body = {"model": "deepseek-v3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                async with s.post(url, json=body) as r:
                    assert r.status == 200, emu.name
    finally:
        for emu in fleet:
            await emu.stop()


def test_cli_kv_event_and_model_flags_map_to_the_config() -> None:
    args = build_parser().parse_args([
        "--runtime", "vllm", "--port", "0", "--block-size", "32", "--num-kv-blocks", "64", "--embedding-dim", "16",
        "--kv-events", "tcp://127.0.0.1:5557", "--kv-events-topic", "kv", "--kv-events-encoding", "array",
        "--kv-events-replay", "tcp://127.0.0.1:5558", "--kv-events-drop", "3, 5", "--kv-events-silent-after", "9"])
    cfg = config_from_args(args)
    assert (cfg.block_size, cfg.num_kv_blocks, cfg.embedding_dim) == (32, 64, 16)
    kv = cfg.kv_events
    assert kv is not None
    assert (kv.endpoint, kv.topic, kv.encoding, kv.replay_endpoint) == (
        "tcp://127.0.0.1:5557", "kv", "array", "tcp://127.0.0.1:5558")
    assert kv.drop_batches == frozenset({3, 5})
    assert kv.silent_after == 9
    assert config_from_args(build_parser().parse_args(["--runtime", "vllm", "--port", "0"])).kv_events is None


async def test_cli_publishes_kv_events_to_a_bound_subscriber() -> None:
    """`gateway emulate --kv-events tcp://127.0.0.1:PORT` in its own process connects its PUB to
    the subscriber, as vLLM does."""
    from tests.emulator.kv_harness import Subscriber
    from tests.emulator.test_kv_events import free_port

    async with Subscriber(b"kv", replay_endpoint=f"tcp://127.0.0.1:{free_port()}") as sub:
        assert sub.replay_endpoint is not None
        async with cli("vllm", "--kv-events", sub.endpoint, "--kv-events-topic", "kv",
                       "--kv-events-replay", sub.replay_endpoint) as (line, url):
            assert f"kv_events={sub.endpoint}" in line
            await sub.connected()
            body = {"model": "m", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "A prompt long enough to fill a block. " * 4}]}
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
            (batch,) = await sub.receive_until(1)
            assert batch.topic == b"kv"
            assert batch.seq == 0
            assert batch.events[0].kind == "BlockStored"
            assert batch.events[0].parent is None
