"""KV-cache events as the runtimes publish them, decoded into one model (pure).

* vLLM (`vllm/distributed/kv_events.py`): ZMQ frames `[topic, seq (8-byte big-endian), payload]`;
  the payload is msgpack `[ts, [events], data_parallel_rank]`. Since vLLM PR #42892 (0.32) each
  event is a map tagged `"type"` with default fields omitted; before, a positional array with the
  class name first: `BlockStored [tag, block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, ...]`, `BlockRemoved [tag, block_hashes,
  medium, group_idx, ...]`, `AllBlocksCleared [tag]`. Block hashes are ints (or bytes with
  `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
* SGLang (`srt/disaggregation/kv_events.py`): the same framing and the positional layout (the
  first seven fields of a store, three of a removal); the batch's third field is the attention DP
  rank; hashes are signed 64-bit ints; one store per page.
* trtllm-serve (`POST /kv_cache_events`): JSON `[{event_id, data, window_size}]` with `data` one of
  `created`, `stored` {parent_hash, blocks: [{block_hash, tokens: [{token_id, token_extra_id}],
  cache_level, ...}]}, `removed` {block_hashes}, `updated` (priorities; ignored here).

A store the gateway cannot key from token ids alone (a LoRA adapter, multimodal or cache-salt
extra keys, a CPU or secondary-tier medium, a KV-cache group other than the first, extra token
ids) is decoded as `usable=False`: it is never indexed, and neither are its descendants (their
parent stays unresolved), so it can only cost a missed hit, never a false one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

Hash = int | bytes  # an engine's block hash, as it publishes it
_GPU = (None, "GPU", "gpu", "cuda")


class KvDecodeError(ValueError):
    """A message that is not a KV-event batch of any known encoding."""


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[Hash, ...]
    parent: Hash | None
    token_ids: tuple[int, ...]
    block_size: int
    usable: bool = True


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[Hash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


@dataclass(frozen=True, slots=True)
class Created:
    """trtllm-serve's first event: its cache manager (and so its cache) just started."""


KvEvent = Stored | Removed | Cleared | Created
IGNORED: tuple[KvEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class Batch:
    """One engine step's events (vLLM, SGLang) with its sequence number and DP rank."""

    seq: int
    ts: float
    rank: int
    events: tuple[KvEvent, ...]


def _hashes(raw: Any) -> tuple[Hash, ...]:
    if isinstance(raw, list | tuple) and all(isinstance(h, int | bytes) for h in raw):
        return tuple(raw)
    raise KvDecodeError(f"block_hashes: {raw!r:.80}")


def _hash_or_none(raw: Any) -> Hash | None:
    if raw is None or isinstance(raw, int | bytes):
        return raw
    raise KvDecodeError(f"parent hash: {raw!r:.80}")


def _plain(medium: Any, lora_id: Any, lora_name: Any, extra_keys: Any, group: Any) -> bool:
    if medium not in _GPU or lora_id is not None or lora_name is not None or group not in (None, 0):
        return False
    return extra_keys is None or all(k is None for k in extra_keys)


def _stored(hashes: Any, parent: Any, tokens: Any, block_size: Any, usable: bool) -> Stored:
    bh = _hashes(hashes)
    if not isinstance(block_size, int) or block_size < 1:
        raise KvDecodeError(f"block_size: {block_size!r}")
    if not isinstance(tokens, list | tuple) or not all(isinstance(t, int) for t in tokens):
        raise KvDecodeError("token_ids")
    if len(tokens) < block_size * len(bh):
        usable = False  # a store that does not carry its blocks' tokens cannot be keyed
    return Stored(bh, _hash_or_none(parent), tuple(tokens), block_size, usable)


def decode_event(raw: Any) -> KvEvent | None:
    """One vLLM/SGLang event (tagged map or positional array); None for kinds the index ignores."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == "BlockStored":
            usable = _plain(raw.get("medium"), raw.get("lora_id"), raw.get("lora_name"), raw.get("extra_keys"),
                            raw.get("group_idx"))
            return _stored(raw.get("block_hashes"), raw.get("parent_block_hash"), raw.get("token_ids"),
                           raw.get("block_size"), usable)
        if kind == "BlockRemoved":
            if raw.get("medium") not in _GPU or raw.get("group_idx") not in (None, 0):
                return None
            return Removed(_hashes(raw.get("block_hashes")))
        if kind == "AllBlocksCleared":
            return Cleared()
        return None
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        if kind == "BlockStored":
            if len(raw) < 5:
                raise KvDecodeError("BlockStored: too few fields")
            f = [*raw, *([None] * 10)]
            usable = _plain(f[6], f[5], f[7], f[8], f[9])
            return _stored(raw[1], raw[2], raw[3], raw[4], usable)
        if kind == "BlockRemoved":
            if len(raw) < 2:
                raise KvDecodeError("BlockRemoved: too few fields")
            f = [*raw, None, None]
            if f[2] not in _GPU or f[3] not in (None, 0):
                return None
            return Removed(_hashes(raw[1]))
        if kind == "AllBlocksCleared":
            return Cleared()
        return None
    raise KvDecodeError(f"event: {raw!r:.80}")


def decode_payload(seq: int, payload: bytes) -> Batch:
    """A msgpack batch `[ts, [events], dp_rank]` (rank optional) with its sequence number."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise KvDecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(body, list | tuple) or len(body) < 2 or not isinstance(body[1], list | tuple):
        raise KvDecodeError("not a [ts, events, rank] batch")
    ts = body[0]
    rank = body[2] if len(body) > 2 and isinstance(body[2], int) else 0
    events = []
    for raw in body[1]:
        ev = decode_event(raw)
        if ev is not None:
            events.append(ev)
    return Batch(seq, float(ts) if isinstance(ts, int | float) else 0.0, rank, tuple(events))


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvDecodeError(f"sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


def decode_frames(frames: Sequence[bytes]) -> Batch:
    """A live message `[topic, seq, payload]`."""
    if len(frames) != 3:
        raise KvDecodeError(f"{len(frames)} frames, expected [topic, seq, payload]")
    return decode_payload(decode_seq(frames[1]), frames[2])


# --- trtllm-serve -----------------------------------------------------------------------------


def decode_trtllm(items: Any) -> list[tuple[int, KvEvent | None]]:
    """`POST /kv_cache_events`'s answer: (event_id, event) in order; None for ignored kinds."""
    if not isinstance(items, list):
        raise KvDecodeError("trtllm events: not a list")
    out: list[tuple[int, KvEvent | None]] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("event_id"), int):
            raise KvDecodeError(f"trtllm event: {item!r:.80}")
        data = item.get("data")
        kind = data.get("type") if isinstance(data, dict) else None
        ev: KvEvent | None = None
        if kind == "created":
            ev = Created()
        elif kind == "removed":
            ev = Removed(_hashes(data.get("block_hashes")))  # type: ignore[union-attr]
        elif kind == "stored":
            ev = _trtllm_stored(data)  # type: ignore[arg-type]
        out.append((item["event_id"], ev))
    return out


def _trtllm_stored(data: dict[str, Any]) -> Stored:
    blocks = data.get("blocks")
    if not isinstance(blocks, list) or not blocks:
        raise KvDecodeError("trtllm stored: no blocks")
    hashes: list[Hash] = []
    tokens: list[int] = []
    usable = True
    size = 0
    for block in blocks:
        if not isinstance(block, dict) or not isinstance(block.get("block_hash"), int):
            raise KvDecodeError("trtllm stored: block")
        hashes.append(block["block_hash"])
        toks = block.get("tokens") or []
        if size == 0:
            size = len(toks)
        if len(toks) != size or block.get("cache_level", 0) != 0 or block.get("lora_id") is not None:
            usable = False
        for t in toks:
            tid = t.get("token_id") if isinstance(t, dict) else None
            if not isinstance(tid, int):
                raise KvDecodeError("trtllm stored: token")
            if t.get("token_extra_id"):
                usable = False
            tokens.append(tid)
    if size < 1:
        raise KvDecodeError("trtllm stored: empty block")
    return Stored(tuple(hashes), _hash_or_none(data.get("parent_hash")), tuple(tokens), size, usable)
