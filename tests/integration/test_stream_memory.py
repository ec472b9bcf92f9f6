"""An open stream does not hold its request: the body's bytes and its parsed JSON are let go once the
stream has started (`Dispatcher.dispatch`, `native_front.take_body`, `Relay.stream`), so the memory a
gateway holds per open stream does not grow with the prompt. Measured as the serving process's
resident memory while 40 streams of 64 KiB prompts are held open by a backend that sends
one event and then waits (tests/integration/fakes.py); before, each held ~2x its request (44.8 KiB
a stream for a 16 KiB request, bench/results/scale-analysis.md). A real `gateway serve`, the
official SDK. Closing the streams ends them at the backend too, though it is silent: the FIN each
client sends is answered with an SSE comment, whose RST shows the client gone (`http/halfclose.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from .fakes import HoldingStreamServer, start_holding_stream_server
from .harness import GatewayProcess, LoopThread, eventually

StartGateway = Callable[..., GatewayProcess]
PROMPT_BYTES = 64 * 1024
STREAMS = 40


@pytest.fixture
def holding(loop_thread: LoopThread) -> Iterator[HoldingStreamServer]:
    server = loop_thread.run(start_holding_stream_server())
    yield server
    server.server.close()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def messages(i: int) -> list[ChatCompletionMessageParam]:
    """A 64 KiB system prompt that every request shares (so the prefix index learns it once, and what
    grows is only what each stream holds) and a question of its own."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}?"}]


SYSTEM = ("You answer from this manual only. " * (PROMPT_BYTES // 33 + 1))[:PROMPT_BYTES]


def hold(client: openai.OpenAI, n: int, first: int) -> list[openai.Stream[ChatCompletionChunk]]:
    """Open `n` streams one after another, each held once its first event has arrived."""
    streams = []
    for i in range(first, first + n):
        stream = client.chat.completions.create(model="moe", messages=messages(i), stream=True)
        chunk = next(iter(stream))
        assert chunk.choices[0].delta.role == "assistant"
        streams.append(stream)
    return streams


@pytest.mark.parametrize("policy", ["round_robin", "prefix_affinity"])
def test_an_open_stream_does_not_hold_its_prompt(holding: HoldingStreamServer, gateway: StartGateway,
                                                 policy: str) -> None:
    gw = gateway([{"name": "held", "runtime": "vllm", "url": holding.url, "model": "tiny-moe"}],
                 [{"model": "moe", "backends": ["held"], "policy": policy}])
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
    warm = hold(client, 8, 0)  # the allocator's arenas, the connection pool, the code paths
    assert holding.received > PROMPT_BYTES  # the whole prompt reached the backend
    before = rss_kib(gw.proc.pid)
    streams = hold(client, STREAMS, 100)
    eventually(lambda: holding.open == len(warm) + STREAMS)
    per_stream = (rss_kib(gw.proc.pid) - before) / STREAMS
    for s in warm + streams:
        s.close()
    client.close()
    eventually(lambda: holding.open == 0)  # every upstream stream closed, none waiting for a token
    # Held, the request would be >= 2 x 64 KiB a stream (142 KiB with round_robin, 184 with
    # prefix_affinity, before); let go, what is left is the stream's own ~12 KiB, plus, where the
    # policy reads the prompt's blocks, the routing ticket's block hashes (~40 KiB for this prompt),
    # kept to correct the prefix index when the response ends.
    limit = PROMPT_BYTES / 1024 * (1.5 if policy == "prefix_affinity" else 0.5)
    assert per_stream < limit, f"{per_stream:.1f} KiB of resident memory per open stream"
