"""KV-event encodings and block hashes against what the runtimes produce (pure; no sockets):
msgpack bytes equal to vLLM's and SGLang's own msgspec classes, a real vLLM 0.32's event stream
and block hashes (tests/data/emulator), the caches' event reports, trtllm-serve's JSON queue."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from backends.emulator.block_hashes import sglang_hashes, trtllm_hashes, vllm_hashes
from backends.emulator.config import KvEventsConfig
from backends.emulator.kv_events import Cleared, EventCollector, KvEvent, Removed, Stored, encode_batch
from backends.emulator.prefix_cache import BlockHashCache, RadixCache
from backends.emulator.trtllm_kv_events import TrtllmKvEventQueue
from tests.data import EMULATOR_CAPTURES as OWN_CAPTURES
from tests.emulator.kv_harness import Replica, decode_batch

VLLM_DIR = OWN_CAPTURES / "vllm-0.32.0-cpu"
GOLDEN = json.loads((OWN_CAPTURES / "kv_events_encodings.json").read_text())
TS = 1796113315.7229643


def captured_json(name: str) -> Any:
    text = (VLLM_DIR / f"{name}.txt").read_text()
    req, resp = text.split("### response\n", 1)
    return json.loads(req.split("\n\n", 1)[1]), json.loads(resp.split("\n\n", 1)[1])


def captured_stream() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (VLLM_DIR / "kv_events.jsonl").read_text().splitlines() if line]


@pytest.mark.parametrize("style", ["vllm-map", "vllm-array"])
def test_vllm_encodings_are_byte_equal_to_vllms_msgspec(style: str) -> None:
    a, b = 4832495118715771974, 16951368705828681226
    events: list[KvEvent] = [Stored((a, b), None, tuple(range(1000, 1008)), 4), Stored((7,), b, (1, 2, 3, 4), 4),
                             Removed((7,)), Cleared()]
    key = "vllm_map" if style == "vllm-map" else "vllm_array"
    assert encode_batch(style, TS, events).hex() == GOLDEN[key]


def test_sglang_encoding_is_byte_equal_to_sglangs_msgspec() -> None:
    events: list[KvEvent] = [Stored((-5, 9), None, (11,), 1), Stored((3,), -5, (12,), 1), Removed((3,)), Cleared()]
    assert encode_batch("sglang", TS, events).hex() == GOLDEN["sglang"]


def test_unknown_encoding_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV event encoding"):
        encode_batch("protobuf", TS, [Cleared()])


def test_vllm_hashes_equal_a_real_vllms_events() -> None:
    """The captured first prompt's tokens, hashed as vLLM 0.32 does, give the hashes its first
    BlockStored carried (block size 128 on CPU)."""
    _, tokenized = captured_json("kv_tokenize_0")
    tokens = tokenized["tokens"]
    first = decode_batch(b"kv", (0).to_bytes(8, "big"), bytes.fromhex(captured_stream()[0]["payload_hex"]))
    stored = first.events[0]
    assert stored.kind == "BlockStored"
    assert stored.parent is None
    assert stored.block_size == 128
    assert list(stored.hashes) == vllm_hashes(tokens, 128)
    assert list(stored.token_ids) == tokens[: 128 * len(stored.hashes)]


def test_captured_stream_framing_and_key_order_match_the_emulators() -> None:
    lines = captured_stream()
    assert [line["seq"] for line in lines] == list(range(len(lines)))
    assert {line["topic"] for line in lines} == {"kv"}
    ours = {e["type"]: list(e) for e in msgpack.unpackb(
        encode_batch("vllm-map", TS, [Stored((1,), None, (1,), 1), Removed((1,)), Cleared()]))[1]}
    replica = Replica()
    seen = set()
    for line in lines:
        payload = msgpack.unpackb(bytes.fromhex(line["payload_hex"]))
        ts, events, rank = payload
        assert isinstance(ts, float)
        assert rank == 0
        for raw in events:
            assert list(raw) == ours[raw["type"]], raw["type"]
            seen.add(raw["type"])
        replica.apply(decode_batch(b"kv", line["seq"].to_bytes(8, "big"), bytes.fromhex(line["payload_hex"])).events)
    assert seen == {"BlockStored", "BlockRemoved"}
    assert replica.removed > 0  # the capture evicted from its 17-block pool


def test_block_hash_cache_reports_stores_and_evictions() -> None:
    sink = EventCollector()
    cache = BlockHashCache(4, hasher=vllm_hashes, sink=sink)
    a = list(range(10))  # two full blocks and a partial one
    cache.insert(a)
    (ev,) = sink.take()
    assert ev == Stored(tuple(vllm_hashes(a, 4)), None, tuple(a[:8]), 4)
    b = [*a[:4], 99, 98, 97, 96, 95]
    cache.insert(b)
    (ev2,) = sink.take()  # only the new block, with the shared block as parent
    assert ev2 == Stored((vllm_hashes(b, 4)[1],), vllm_hashes(a, 4)[0], (99, 98, 97, 96), 4)
    assert cache.match(b) == 8
    cache.evict_to(4)  # least recently used first: the chain tails go before the shared head
    removed = sink.take()
    assert removed == [Removed((vllm_hashes(a, 4)[1],)), Removed((vllm_hashes(b, 4)[1],))]
    assert cache.resident_hashes() == {vllm_hashes(a, 4)[0]}
    cache.clear()
    assert sink.take() == [Cleared()]
    assert cache.size_tokens == 0


def test_radix_cache_reports_pages_and_whole_leaf_evictions() -> None:
    sink = EventCollector()
    cache = RadixCache(2, sink=sink)
    a = [1, 2, 3, 4, 5, 6, 7]
    cache.insert(a)
    ha = sglang_hashes(a, 2)
    assert sink.take() == [Stored((ha[0],), None, (1, 2), 2), Stored((ha[1],), ha[0], (3, 4), 2),
                           Stored((ha[2],), ha[1], (5, 6), 2)]
    b = [1, 2, 3, 4, 9, 9]
    cache.insert(b)  # splits the node after two pages; the split itself publishes nothing
    hb = sglang_hashes(b, 2)
    assert hb[:2] == ha[:2]
    assert sink.take() == [Stored((hb[2],), ha[1], (9, 9), 2)]
    assert cache.match(a) == 6  # refreshes a's leaf: b's is now the least recently used
    cache.evict_to(6)
    assert sink.take() == [Removed((hb[2],))]
    assert cache.resident_hashes() == set(ha)
    cache.evict_to(0)
    assert sink.take() == [Removed((ha[2],)), Removed((ha[0],)), Removed((ha[1],))]


async def test_trtllm_queue_numbers_merges_and_bounds_events() -> None:
    q = TrtllmKvEventQueue(KvEventsConfig(max_events=4), window_size=2048, primary_blocks=16, poll_timeout_s=0.01)
    h = trtllm_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    q.publish([Stored(tuple(h), None, (1, 2, 3, 4, 5, 6, 7, 8), 4)])
    q.publish([Removed((h[1],)), Removed((h[0],)), Cleared()])
    got = await q.drain()
    assert [e["event_id"] for e in got] == [0, 1, 2]
    assert got[0]["data"] == {"type": "created", "num_blocks_per_cache_level": [16, 0]}
    stored = got[1]["data"]
    assert stored["type"] == "stored"
    assert stored["parent_hash"] is None
    assert [b["block_hash"] for b in stored["blocks"]] == h
    assert [t["token_id"] for t in stored["blocks"][1]["tokens"]] == [5, 6, 7, 8]
    assert got[2]["data"] == {"type": "removed", "block_hashes": [h[1], h[0]]}  # consecutive removals merged
    assert await q.drain() == []  # drained, and an empty queue answers [] after the poll timeout
    for i in range(6):
        q.publish([Removed((i,)), Stored((i,), None, (i,), 1)])
    kept = await q.drain()
    assert len(kept) == 4
    assert kept[-1]["event_id"] == 14
    q.drop_next()
    q.publish([Removed((1,))])
    q.publish([Removed((2,))])
    assert [e["event_id"] for e in await q.drain()] == [16]  # a dropped batch still consumes its ids


def test_trtllm_hash_chains_on_the_parent() -> None:
    h = trtllm_hashes(list(range(8)), 4)
    assert len(h) == 2
    assert h[0] != h[1]
    assert trtllm_hashes([*list(range(4)), 9, 9, 9, 9], 4)[0] == h[0]
    assert trtllm_hashes([9, 9, 9, 9, *list(range(4, 8))], 4)[1] != h[1]
    assert all(0 <= x < 1 << 64 for x in h)
