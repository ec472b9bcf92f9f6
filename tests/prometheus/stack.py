"""The whole stack for the Prometheus tier: emulators of four runtimes, a real `gateway serve`
process in front of them, a real Prometheus scraping it every second, and mixed client traffic
through the official OpenAI SDK, tallied on the client side for comparison with what Prometheus saw.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import yaml
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.harness import ROOT, Emulators, backend_entry, stop_group

# Two workers: every scrape lands on one of them and must still report the whole gateway (the
# supervisor merges both workers' families), so every assertion of the tier holds for the gateway.
WORKERS = 2


WARM_UP_S = 2.0  # traffic before the counted window: the request series are born in it
LOAD_S = 8.0  # wall time of the counted traffic: several scrapes while it runs
COUNTED = 240  # ... and at least this many requests (the tests need over 200 to mean something)
CLIENTS = 4


class ServedGateway:
    """`python -m gateway serve --config FILE --port 0 [--workers N]`, stopped by its process group."""

    def __init__(self, config: dict[str, Any], workdir: Path, *, workers: int) -> None:
        path = workdir / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "gateway.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--host", "127.0.0.1", "--port", "0",
             "--workers", str(workers)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "gateway listening on URL" [+ " (N workers)"]
        if not line.startswith("gateway listening on "):
            self.stop()
            raise RuntimeError(f"gateway did not start: {line!r}\n{self.log_path.read_text()}")
        self.url = line.split()[3]
        self.address = self.url.removeprefix("http://")

    def stop(self) -> None:
        stop_group(self.proc, grace_s=15)
        self._log.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


PRICES = {"vllm-a": 24.0, "sglang-a": 28.0, "trtllm-a": 32.0, "triton-a": 30.0}  # vllm-b, vllm-c: no price


def fleet_config(emulators: Emulators) -> dict[str, Any]:
    """Six backends of four runtimes; vllm-b fails its first 4 generations with 500 (the clients see
    them, and outlier detection ejects it after 2 in a row), vllm-c refuses its first 3 with 503
    (retried elsewhere: the engine did no work), triton-a answers 8% of them with a 500."""
    emus = {
        "vllm-a": ("vllm", emulators.start("vllm")),
        "vllm-b": ("vllm", emulators.start("vllm", fail_first=4, fail_status=500)),
        "vllm-c": ("vllm", emulators.start("vllm", fail_first=3, fail_status=503)),
        "sglang-a": ("sglang", emulators.start("sglang")),
        "trtllm-a": ("trtllm", emulators.start("trtllm")),
        "triton-a": ("triton", emulators.start("triton", fail_rate=0.08, fail_status=500)),
    }
    backends = []
    for name, (runtime, emu) in emus.items():
        extra = {"usd_per_hour": PRICES[name]} if name in PRICES else {}
        backends.append(backend_entry(name, emu, runtime, **extra))
    return {
        "backends": backends,
        "routes": [
            {"model": "moe", "backends": list(emus), "policy": "round_robin"},
            {"model": "ab", "policy": "least_load", "split": {
                "arms": [{"name": "vllm", "weight": 50, "backends": ["vllm-a"]},
                         {"name": "sglang", "weight": 50, "backends": ["sglang-a"]}],
                "shadow": {"arm": "sglang", "fraction": 0.1},
            }},
        ],
        "health": {"interval_s": 0.5, "failure_threshold": 2, "cooldown_s": 0.5},
    }


@dataclass
class Tally:
    """What the clients sent and saw, per runtime (from `x-gateway-runtime`)."""

    sent: int = 0
    ok: Counter[str] = field(default_factory=Counter)
    prompt_tokens: Counter[str] = field(default_factory=Counter)
    completion_tokens: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)  # by HTTP status
    streamed: int = 0
    started_at: float = 0.0
    ended_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_ok(self, runtime: str, usage: Any) -> None:
        with self._lock:
            self.sent += 1
            self.ok[runtime] += 1
            self.prompt_tokens[runtime] += usage.prompt_tokens
            self.completion_tokens[runtime] += usage.completion_tokens

    def add_failed(self, status: int) -> None:
        with self._lock:
            self.sent += 1
            self.failed[str(status)] += 1


def one_request(client: openai.OpenAI, n: int, tally: Tally) -> None:
    """Request number `n` of a fixed mix: both routes, streaming (always with usage) and not, some
    with latency targets that will be met (2 s) or missed (1 ms), sessions for the A/B split."""
    model = "ab" if n % 3 == 0 else "moe"
    stream = n % 2 == 0
    headers = {"x-session-id": f"s{n % 17}"}
    if n % 5 == 0:
        headers["x-sla-ttft-ms"] = "2000" if n % 10 == 0 else "1"
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": f"request {n}: say something about mixtures of experts"}]
    try:
        if stream:
            streamed = client.chat.completions.with_raw_response.create(
                model=model, messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True},
                extra_headers=headers,
            )
            runtime, usage = streamed.headers["x-gateway-runtime"], None
            for chunk in streamed.parse():
                if chunk.usage is not None:
                    usage = chunk.usage
            assert usage is not None, "a stream with include_usage ended without usage"
            with tally._lock:
                tally.streamed += 1
        else:
            whole = client.chat.completions.with_raw_response.create(
                model=model, messages=messages, max_tokens=12, extra_headers=headers)
            runtime, usage = whole.headers["x-gateway-runtime"], whole.parse().usage
            assert usage is not None
        tally.add_ok(runtime, usage)
    except openai.APIStatusError as exc:
        tally.add_failed(exc.status_code)


def drive(base_url: str, tally: Tally, *, seconds: float = LOAD_S, clients: int = CLIENTS, at_least: int = 0,
          at_most_s: float = 60.0) -> None:
    """`clients` threads, each with its own SDK client, send requests until `seconds` have passed
    and at least `at_least` were sent (a loaded machine serves fewer per second; `at_most_s` bounds
    it); what they see is added to `tally`."""
    tally.started_at = tally.started_at or time.time()
    first = tally.sent
    numbers = itertools.count(first)
    lock = threading.Lock()
    started = time.monotonic()
    deadline, cap = started + seconds, started + at_most_s

    def more(n: int) -> bool:
        now = time.monotonic()
        return now < cap and (now < deadline or n - first < at_least)

    def worker() -> None:
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30) as client:
            while True:
                with lock:
                    n = next(numbers)
                if not more(n):
                    return
                one_request(client, n, tally)

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker) for _ in range(clients)]:
            f.result()
    tally.ended_at = time.time()
