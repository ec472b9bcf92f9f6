"""Decoding the runtimes' KV events: the bytes vLLM's and SGLang's own msgspec classes produce
(tests/data/emulator/kv_events_encodings.json), a live vLLM 0.32's stream, trtllm-serve's JSON."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from backends.emulator.config import KvEventsConfig
from backends.emulator.kv_events import Cleared as EmuCleared
from backends.emulator.kv_events import Removed as EmuRemoved
from backends.emulator.kv_events import Stored as EmuStored
from backends.emulator.trtllm_kv_events import TrtllmKvEventQueue
from gateway.kvcache.events import (
    Cleared,
    Created,
    KvDecodeError,
    Removed,
    Stored,
    decode_event,
    decode_frames,
    decode_payload,
    decode_trtllm,
)
from tests.data import EMULATOR_CAPTURES

GOLDEN = json.loads((EMULATOR_CAPTURES / "kv_events_encodings.json").read_text())
A, B = 4832495118715771974, 16951368705828681226


@pytest.mark.parametrize("key", ["vllm_map", "vllm_array"])
def test_vllms_own_encodings(key: str) -> None:
    batch = decode_payload(7, bytes.fromhex(GOLDEN[key]))
    assert batch.seq == 7
    assert batch.rank == 0
    assert batch.events == (
        Stored((A, B), None, tuple(range(1000, 1008)), 4),
        Stored((7,), B, (1, 2, 3, 4), 4),
        Removed((7,)),
        Cleared(),
    )


def test_sglangs_own_encoding() -> None:
    batch = decode_payload(0, bytes.fromhex(GOLDEN["sglang"]))
    # the golden batch's first store names two pages but carries one token: it cannot be keyed
    assert batch.events == (Stored((-5, 9), None, (11,), 1, usable=False), Stored((3,), -5, (12,), 1), Removed((3,)),
                            Cleared())


def test_a_live_vllm_stream_decodes() -> None:
    text = (EMULATOR_CAPTURES / "vllm-0.32.0-cpu" / "kv_events.jsonl").read_text()
    lines = [json.loads(x) for x in text.splitlines()]
    batches = [decode_frames([x["topic"].encode(), x["seq"].to_bytes(8, "big"), bytes.fromhex(x["payload_hex"])])
               for x in lines]
    assert [b.seq for b in batches] == list(range(len(lines)))
    first = batches[0].events[0]
    assert isinstance(first, Stored)
    assert (first.block_size, first.parent, len(first.block_hashes), first.usable) == (128, None, 2, True)
    assert {type(e) for b in batches for e in b.events} == {Stored, Removed}


def stored_map(**over: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [5, 6],
            "block_size": 2, "medium": "GPU", "lora_name": None, "extra_keys": [None], **over}


@pytest.mark.parametrize("over", [
    {"lora_name": "adapter"}, {"lora_id": 3}, {"extra_keys": [["mm-hash"]]}, {"medium": "CPU"}, {"group_idx": 1},
    {"token_ids": [5]},  # fewer tokens than its blocks: cannot be keyed
])
def test_stores_that_token_ids_alone_cannot_key_are_not_usable(over: dict[str, Any]) -> None:
    ev = decode_event(stored_map(**over))
    assert isinstance(ev, Stored)
    assert not ev.usable
    assert decode_event(stored_map()) == Stored((1,), None, (5, 6), 2)


def test_removals_of_other_tiers_are_ignored_and_unknown_kinds_skipped() -> None:
    assert decode_event({"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}) is None
    assert decode_event(["BlockRemoved", [1], "CPU"]) is None
    assert decode_event({"type": "SomethingNew"}) is None
    assert decode_event(["BlockRemoved", [b"\x01" * 32], "GPU"]) == Removed((b"\x01" * 32,))  # bytes hashes


@pytest.mark.parametrize("raw", [
    b"\xc1", msgpack.packb({"not": "a batch"}), msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x"}], 0]),
    msgpack.packb([1.0, [["BlockStored", [1]]], 0]),
])
def test_malformed_payloads_raise(raw: bytes) -> None:
    with pytest.raises(KvDecodeError):
        decode_payload(0, raw)
    with pytest.raises(KvDecodeError):
        decode_frames([b"kv", b"\x00" * 4, raw])


async def test_trtllm_serves_json_the_decoder_reads() -> None:
    queue = TrtllmKvEventQueue(KvEventsConfig(), window_size=2048, primary_blocks=16, poll_timeout_s=0.01)
    queue.publish([EmuStored((11, 12), None, (1, 2, 3, 4), 2), EmuRemoved((11,)), EmuRemoved((12,)), EmuCleared()])
    items = decode_trtllm(await queue.drain())
    assert items == [(0, Created()), (1, Stored((11, 12), None, (1, 2, 3, 4), 2)), (2, Removed((11, 12)))]
    assert decode_trtllm([{"event_id": 9, "data": {"type": "updated", "block_hash": 1}}]) == [(9, None)]
    extra = [{"event_id": 0, "data": {"type": "stored", "parent_hash": None, "blocks": [
        {"block_hash": 1, "tokens": [{"token_id": 1, "token_extra_id": 4}], "cache_level": 0}]}}]
    [(_, ev)] = decode_trtllm(extra)
    assert isinstance(ev, Stored)
    assert not ev.usable
    with pytest.raises(KvDecodeError):
        decode_trtllm({"event_id": 1})
