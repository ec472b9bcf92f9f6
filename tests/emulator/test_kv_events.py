"""KV-cache events from running emulators (issue 17): a SUB socket bound on loopback (vLLM and
SGLang connect their PUB to it) or trtllm-serve's `POST /kv_cache_events` receives events that
describe exactly what the emulator's prefix cache stores and evicts, with the runtime's block
hashes and the emulator's token ids, and a replica built from them predicts `cached_tokens`."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends.base import Runtime
from backends.emulator import EmulatorConfig, KvEventsConfig, RunningEmulator, start_emulator, tokenizer
from backends.emulator.block_hashes import sglang_hashes, trtllm_hashes, vllm_hashes
from backends.emulator.kv_zmq import ZmqKvPublisher
from tests.emulator.conftest import FAST, MakeEmulator
from tests.emulator.kv_harness import Batch, Ev, Replica, Subscriber, replay

S1 = "You are a careful assistant for an online bookshop. " * 6
S2 = "Completely different text about mountains and rivers. " * 8


def conversation(system: str, question: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


# Shared prefix, a hit, a long unrelated prompt that forces eviction from the small pool, then the
# first prefix again (partly evicted) and the second one again (partly resident).
SEQUENCE = [
    conversation(S1, "Which novel about the sea?"),
    conversation(S1, "Any poetry?"),
    conversation(S2, "Describe them."),
    conversation(S1, "Something for children?"),
    conversation(S2, "And the weather there?"),
]


async def prompt_tokens(emu: RunningEmulator, messages: list[ChatCompletionMessageParam]) -> list[int]:
    """The emulator's own tokens for a chat prompt (checked against the reply's `prompt_tokens`)."""
    return tokenizer.encode(tokenizer.render_chat([dict(m) for m in messages], add_generation_prompt=True))


def resident(emu: RunningEmulator) -> set[int]:
    cache: Any = emu.ctx.driver.engine.cache
    return set(cache.resident_hashes())


def publisher(emu: RunningEmulator) -> ZmqKvPublisher:
    pub = emu.kv_events
    assert isinstance(pub, ZmqKvPublisher)
    return pub


async def sync(sub: Subscriber, emu: RunningEmulator) -> list[Batch]:
    """Every batch the emulator published so far (it publishes before it answers)."""
    pub = publisher(emu)
    if pub.sent == 0 or (sub.batches and sub.batches[-1].seq >= pub.seq - 1):
        return []
    return await sub.receive_until(pub.seq)


Hasher = Callable[[list[int], int], list[int]]


async def run_sequence(
    emu: RunningEmulator, replica: Replica, hasher: Hasher, granularity: int,
    fetch: Callable[[], Any],
) -> list[tuple[int, int]]:
    """Send SEQUENCE one request at a time; before each, predict its cached tokens from the replica
    (whole blocks of the prompt before its last token, which is always recomputed); after each,
    apply the new events and check the replica equals the cache. Returns (predicted, reported)."""
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    out = []
    for messages in SEQUENCE:
        tokens = await prompt_tokens(emu, messages)
        predicted = granularity * replica.leading_hits(hasher(tokens[:-1], granularity))
        reply = await client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=4)
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == len(tokens)
        details = reply.usage.prompt_tokens_details
        assert details is not None
        assert details.cached_tokens is not None
        out.append((predicted, details.cached_tokens))
        replica.apply(await fetch())
        assert replica.resident == resident(emu)
    await client.close()
    return out


def check_outcome(outcome: list[tuple[int, int]], replica: Replica) -> None:
    assert [p for p, _ in outcome] == [c for _, c in outcome]
    assert outcome[0][1] == 0
    assert outcome[1][1] > 0
    assert outcome[3][1] < outcome[1][1]  # the first prefix was partly evicted by the long prompt
    assert replica.removed > 0


@asynccontextmanager
async def zmq_emulator(runtime: str, sub: Subscriber, **kw: Any) -> AsyncIterator[RunningEmulator]:
    """An emulator publishing to `sub` (and replaying on `sub.replay_endpoint`, if it has one)."""
    extra = {k: kw.pop(k) for k in ("block_size", "num_kv_blocks") if k in kw}
    kw.setdefault("replay_endpoint", sub.replay_endpoint)
    cfg = EmulatorConfig(runtime=Runtime(runtime), speed=FAST, kv_events=KvEventsConfig(endpoint=sub.endpoint, **kw),
                         **extra)
    emu = await start_emulator(cfg)
    try:
        await sub.connected()
        yield emu
    finally:
        await emu.stop()


def subscriber(runtime: str = "vllm", topic: bytes = b"", *, replay: bool = True) -> Subscriber:
    """A bound SUB; with `replay`, batches lost while its subscription was in flight are replayed."""
    rep = f"tcp://127.0.0.1:{free_port()}" if replay else None
    return Subscriber(topic, replay_endpoint=rep, with_topic=runtime == "vllm")


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_vllm_events_mirror_the_cache_and_predict_cached_tokens(encoding: str) -> None:
    async with subscriber("vllm", b"kv") as sub, zmq_emulator("vllm", sub, topic="kv", encoding=encoding,
                                                      block_size=16, num_kv_blocks=16) as emu:
        replica = Replica()

        async def fetch() -> list[Ev]:
            return [e for b in await sync(sub, emu) for e in b.events]

        outcome = await run_sequence(emu, replica, vllm_hashes, 16, fetch)
        check_outcome(outcome, replica)
        # Framing: the subscribed topic, consecutive sequence numbers from 0, DP rank 0.
        assert {b.topic for b in sub.batches} == {b"kv"}
        assert [b.seq for b in sub.batches] == list(range(len(sub.batches)))
        assert all(b.dp_rank == 0 for b in sub.batches)
        raw = sub.batches[0].raw_events[0]
        if encoding == "map":
            assert raw["type"] == "BlockStored"
            assert raw["medium"] == "GPU"
            assert raw["group_idx"] == 0
        else:
            assert raw[0] == "BlockStored"
            assert raw[6] == "GPU"
            assert len(raw) == 15
        # The first store is the first prompt's full blocks, with the emulator's token ids.
        first = sub.batches[0].events[0]
        tokens = await prompt_tokens(emu, SEQUENCE[0])
        n = len(tokens) // 16
        assert first.parent is None
        assert first.block_size == 16
        assert first.hashes == tuple(vllm_hashes(tokens, 16))
        assert first.token_ids == tuple(tokens[: n * 16])


async def test_vllm_reset_prefix_cache_publishes_all_blocks_cleared() -> None:
    async with subscriber() as sub, zmq_emulator("vllm", sub) as emu:
        client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
        await client.chat.completions.create(model="tiny-moe", messages=SEQUENCE[0], max_tokens=2)
        async with aiohttp.ClientSession() as s, s.post(emu.url + "/reset_prefix_cache") as r:
            assert r.status == 200
        batches = await sub.receive_until(publisher(emu).seq)
        assert batches[-1].events == (Ev("AllBlocksCleared"),)
        assert resident(emu) == set()
        await client.close()


@pytest.mark.parametrize("page_size", [1, 4])
async def test_sglang_events_are_per_page_and_predict_cached_tokens(page_size: int) -> None:
    async with subscriber("sglang") as sub, zmq_emulator("sglang", sub, block_size=page_size,
                                                 num_kv_blocks=320 // page_size) as emu:
        replica = Replica()

        async def fetch() -> list[Ev]:
            return [e for b in await sync(sub, emu) for e in b.events]

        outcome = await run_sequence(emu, replica, sglang_hashes, page_size, fetch)
        check_outcome(outcome, replica)
        stored = [e for b in sub.batches for e in b.events if e.kind == "BlockStored"]
        assert all(len(e.hashes) == 1 and e.block_size == page_size for e in stored)  # one event per page
        raw = sub.batches[0].raw_events[0]
        assert raw[0] == "BlockStored"
        assert len(raw) == 9
        assert raw[6] == "GPU"
        # The first prompt's pages, chained page to page from the root.
        tokens = await prompt_tokens(emu, SEQUENCE[0])
        pages = len(tokens) // page_size
        first = stored[:pages]
        assert [e.hashes[0] for e in first] == sglang_hashes(tokens, page_size)[:pages]
        assert [e.parent for e in first] == [None, *[e.hashes[0] for e in first[:-1]]]
        assert [t for e in first for t in e.token_ids] == tokens[: pages * page_size]


async def test_trtllm_kv_cache_events_endpoint(emulator: MakeEmulator) -> None:
    emu = await emulator("trtllm", block_size=16, num_kv_blocks=16, kv_events=KvEventsConfig())
    replica = Replica()
    ids: list[int] = []
    raw_events: list[dict[str, Any]] = []

    async def fetch() -> list[Ev]:
        async with aiohttp.ClientSession() as s, s.post(emu.url + "/kv_cache_events") as r:
            assert r.status == 200
            got = await r.json()
        raw_events.extend(got)
        ids.extend(e["event_id"] for e in got)
        out = []
        for e in got:
            data = e["data"]
            if data["type"] == "stored":
                for i, block in enumerate(data["blocks"]):
                    parent = data["parent_hash"] if i == 0 else data["blocks"][i - 1]["block_hash"]
                    toks = tuple(t["token_id"] for t in block["tokens"])
                    out.append(Ev("BlockStored", (block["block_hash"],), parent, toks, len(toks)))
            elif data["type"] == "removed":
                out.append(Ev("BlockRemoved", tuple(data["block_hashes"])))
        return out

    outcome = await run_sequence(emu, replica, trtllm_hashes, 16, fetch)
    check_outcome(outcome, replica)
    assert ids == list(range(len(ids)))
    assert raw_events[0]["data"] == {"type": "created", "num_blocks_per_cache_level": [16, 0]}
    assert all(e["window_size"] == emu.config.max_model_len for e in raw_events)
    stored = next(e["data"] for e in raw_events if e["data"]["type"] == "stored")
    block = stored["blocks"][0]
    assert list(block) == ["type", "block_hash", "tokens", "cache_level", "priority"]
    assert block["tokens"][0] == {"type": "unique_token", "token_id": block["tokens"][0]["token_id"],
                                  "token_extra_id": 0}
    # Drained: nothing is returned twice (an empty queue answers [] after the poll timeout).
    queue: Any = emu.kv_events
    queue.poll_timeout_s = 0.05
    async with aiohttp.ClientSession() as s, s.post(emu.url + "/kv_cache_events") as r:
        assert await r.json() == []


async def test_trtllm_without_kv_events_answers_an_empty_list(emulator: MakeEmulator) -> None:
    emu = await emulator("trtllm")
    async with aiohttp.ClientSession() as s, s.post(emu.url + "/kv_cache_events") as r:
        assert (r.status, await r.json()) == (200, [])


async def test_dropped_batch_is_a_sequence_gap_that_replay_fills() -> None:
    async with subscriber() as sub, zmq_emulator("vllm", sub, drop_batches=frozenset({2})) as emu:
        client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
        for messages in SEQUENCE[:4]:
            await client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=2)
        pub = publisher(emu)
        assert pub.seq >= 4
        await sub.receive_until(pub.seq)
        seqs = [b.seq for b in sub.batches]
        assert seqs == [s for s in range(pub.seq) if s != 2]  # the gap a consumer must detect
        assert sub.replay_endpoint is not None
        replayed = await replay(sub.replay_endpoint, 2, with_topic=True)
        assert [b.seq for b in replayed] == list(range(2, pub.seq))  # the dropped batch was buffered
        assert replayed[1:] == [b for b in sub.batches if b.seq >= 3]
        replica = Replica()
        for b in sorted([*sub.batches, replayed[0]], key=lambda b: b.seq):
            replica.apply(b.events)
        assert replica.resident == resident(emu)
        # The knob at run time: the next batch is consumed but not sent.
        pub.drop_next()
        before = pub.seq
        await client.chat.completions.create(model="tiny-moe", messages=SEQUENCE[4], max_tokens=2)
        assert pub.seq > before
        if pub.seq > before + 1:
            await sub.receive_until(pub.seq)
        assert await sub.quiet()
        assert before not in [b.seq for b in sub.batches]
        await client.close()


async def test_silent_publisher_sends_nothing_more() -> None:
    async with subscriber() as sub, zmq_emulator("vllm", sub, silent_after=2) as emu:
        client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
        for messages in SEQUENCE[:4]:
            await client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=2)
        pub = publisher(emu)
        assert pub.seq >= 3
        assert pub.sent == 2
        await sub.receive_until(2)
        assert await sub.quiet()
        assert [b.seq for b in sub.batches] == [0, 1]
        await client.close()

    async with subscriber("sglang", replay=False) as sub, zmq_emulator("sglang", sub) as emu:
        client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
        pub = publisher(emu)
        pub.silence()
        await client.chat.completions.create(model="tiny-moe", messages=SEQUENCE[0], max_tokens=2)
        assert pub.seq >= 1
        assert pub.sent == 0
        assert await sub.quiet()
        pub.silence(False)
        await client.chat.completions.create(model="tiny-moe", messages=SEQUENCE[2], max_tokens=2)
        got = await sub.receive_until(pub.seq)
        assert got[0].seq >= 1
        await client.close()


async def test_a_restarted_emulator_restarts_its_sequence() -> None:
    async with subscriber() as sub:
        for _ in range(2):
            async with zmq_emulator("vllm", sub) as emu:
                client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
                await client.chat.completions.create(model="tiny-moe", messages=SEQUENCE[0], max_tokens=2)
                await client.close()
                got = await sub.receive_until(publisher(emu).seq)
                assert got[0].seq == 0
                assert got[0].events[0].parent is None
            sub.new_publisher()
        first, second = sub.history
        assert [b.seq for b in first] == [b.seq for b in second] == list(range(len(first)))
        assert first[0].events == second[0].events  # the same prompt stores the same blocks, same hashes


async def test_sglang_replay_answers_without_topic() -> None:
    async with subscriber("sglang") as sub, zmq_emulator("sglang", sub, topic="t") as emu:
        client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
        await client.chat.completions.create(model="tiny-moe", messages=SEQUENCE[0], max_tokens=2)
        await client.close()
        live = await sub.receive_until(publisher(emu).seq)
        assert sub.replay_endpoint is not None
        replayed = await replay(sub.replay_endpoint, 0, with_topic=False)
        assert [(b.seq, b.events) for b in replayed] == [(b.seq, b.events) for b in live]
        assert {b.topic for b in live} == {b"t"}


async def test_kv_event_sources_lists_the_publisher(emulator: MakeEmulator) -> None:
    plain = await emulator("vllm")
    async with aiohttp.ClientSession() as s, s.get(plain.url + "/kv_event_sources") as r:
        assert await r.json() == {}
    async with subscriber() as sub, zmq_emulator("vllm", sub, topic="kv") as emu:
        async with aiohttp.ClientSession() as s, s.get(emu.url + "/kv_event_sources") as r:
            body = await r.json()
        assert list(body) == ["0"]
        assert list(body["0"]) == ["enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint",
                                   "buffer_steps", "hwm", "max_queue_size", "topic"]  # as captured
        assert body["0"]["endpoint"] == sub.endpoint
        assert body["0"]["topic"] == "kv"


async def test_triton_has_no_kv_event_publisher() -> None:
    with pytest.raises(ValueError, match="Triton"):
        await start_emulator(EmulatorConfig(runtime=Runtime.TRITON, kv_events=KvEventsConfig()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
