"""KV-cache events: what the prefix caches report, and how each runtime encodes them (pure).

The caches (`prefix_cache`) report every block they store or evict to a `KvEventSink`; the engine
step that caused them is one *batch* (vLLM and SGLang publish one batch per scheduler step,
trtllm-serve flushes its queue once per iteration). Encodings, verified byte for byte against
msgspec (tests/emulator/captures/kv_events_encodings.json, produced with vLLM 0.32's own classes):

* vLLM 0.32 ("map", since PR #42892): a batch `[ts, [events], data_parallel_rank]` (EventBatch stays
  `array_like`), each event a map tagged `"type"` with `omit_defaults` (fields still `None` dropped
  only when they have a default): `BlockStored` {block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind},
  `BlockRemoved` {block_hashes, medium, group_idx}, `AllBlocksCleared` {}. As captured from a live
  vLLM 0.32 (captures/vllm-0.32.0-cpu/kv_events.jsonl): one `BlockRemoved` per evicted block, and a `BlockStored` per
  step listing that step's newly cached blocks with the parent of the first.
* vLLM "array" (before PR #42892): the same structs positional, tag first, every field present.
* SGLang (`srt/disaggregation/kv_events.py`; the radix cache's `KVCacheEventMixin`): positional
  events, every field present; one `BlockStored` per *page* (`page_size` tokens, 1 by default, so
  one per token) of each new radix node, the previous page as parent (None under the root), and one
  `BlockRemoved` per page of each evicted leaf; node splits emit nothing; batch
  `[ts, events, attn_dp_rank]`.
* trtllm-serve: JSON, see `trtllm_kv_events`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

MEDIUM_GPU = "GPU"


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks newly held by the cache, in chain order; `parent` is the hash before the first."""

    block_hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


class KvEventSink(Protocol):
    def emit(self, event: KvEvent) -> None: ...


class KvPublisher(Protocol):
    """Where a step's events go (ZMQ for vLLM/SGLang, the HTTP queue for trtllm-serve)."""

    def publish(self, events: Sequence[KvEvent]) -> None: ...

    def drop_next(self, count: int = 1) -> None: ...

    def silence(self, silent: bool = True) -> None: ...


class EventCollector:
    """Collects the events of the current engine step; the publisher takes them once per step."""

    def __init__(self) -> None:
        self._pending: list[KvEvent] = []

    def emit(self, event: KvEvent) -> None:
        self._pending.append(event)

    def take(self) -> list[KvEvent]:
        out, self._pending = self._pending, []
        return out


def _vllm_map(ev: KvEvent) -> dict[str, Any]:
    if isinstance(ev, Stored):
        n = len(ev.block_hashes)
        return {"type": "BlockStored", "block_hashes": list(ev.block_hashes), "parent_block_hash": ev.parent,
                "token_ids": list(ev.token_ids), "block_size": ev.block_size, "lora_id": None,
                "medium": MEDIUM_GPU, "lora_name": None, "extra_keys": [None] * n, "group_idx": 0,
                "kv_cache_spec_kind": "full_attention"}
    if isinstance(ev, Removed):
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": MEDIUM_GPU, "group_idx": 0}
    return {"type": "AllBlocksCleared"}


def _vllm_array(ev: KvEvent) -> list[Any]:
    if isinstance(ev, Stored):
        n = len(ev.block_hashes)
        return ["BlockStored", list(ev.block_hashes), ev.parent, list(ev.token_ids), ev.block_size, None,
                MEDIUM_GPU, None, [None] * n, 0, "full_attention", None, None, None, None]
    if isinstance(ev, Removed):
        return ["BlockRemoved", list(ev.block_hashes), MEDIUM_GPU, 0, None, None]
    return ["AllBlocksCleared"]


def _sglang(ev: KvEvent) -> list[Any]:
    if isinstance(ev, Stored):
        return ["BlockStored", list(ev.block_hashes), ev.parent, list(ev.token_ids), ev.block_size, None,
                MEDIUM_GPU, None, None]
    if isinstance(ev, Removed):
        return ["BlockRemoved", list(ev.block_hashes), MEDIUM_GPU]
    return ["AllBlocksCleared"]


def encode_batch(style: str, ts: float, events: Sequence[KvEvent], dp_rank: int = 0) -> bytes:
    """The msgpack payload of one batch; `style` is "vllm-map", "vllm-array" or "sglang"."""
    if style == "vllm-map":
        body: list[Any] = [_vllm_map(e) for e in events]
    elif style == "vllm-array":
        body = [_vllm_array(e) for e in events]
    elif style == "sglang":
        body = [_sglang(e) for e in events]
    else:
        raise ValueError(f"unknown KV event encoding {style!r}")
    out = msgpack.packb([float(ts), body, dp_rank], use_bin_type=True)
    assert isinstance(out, bytes)
    return out
