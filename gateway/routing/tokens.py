"""A prompt as the engine sees it (token ids) and the gateway's own keys for its cache blocks.

Keys do not depend on any engine's hash (no `PYTHONHASHSEED` coupling, one code path for vLLM,
SGLang and TensorRT-LLM): the key of the first `n` tokens of a prompt is

    key(n) = n << 32 | crc32(token ids [0, n) as little-endian uint32)

computed by chaining (`extend`): zlib's CRC takes the previous value as its running state, so the
key of a block follows from its parent's key and the block's own tokens, exactly as the engines'
chained block hashes do. A key depends only on the token prefix it covers, not on where blocks
start, so keys computed for a request at one block size match the keys an engine with that block
size reported, and SGLang's per-token pages share the keys of 16-token positions. The length in
the high bits makes a false match need two prefixes of the same length with the same CRC.
"""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Sequence
from typing import Final

ROOT_KEY: Final = 0  # the key of the empty prefix: the parent of every first block
_LOW32: Final = 0xFFFFFFFF


def pack(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (what keys hash)."""
    arr = array("I", ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def extend(key: int, data: bytes | memoryview) -> int:
    """The key of the prefix `key` covers followed by the tokens packed in `data`."""
    return (((key >> 32) + len(data) // 4) << 32) | zlib.crc32(data, key & _LOW32)


def key_tokens(key: int) -> int:
    """How many tokens the prefix of `key` has."""
    return key >> 32


class TokenPrompt:
    """One request's prompt token ids, with block keys computed on demand and kept.

    The cacheable part is the prompt without its last token: vLLM, SGLang and TensorRT-LLM always
    compute the last prompt token (its logits start the generation), so cached tokens are whole
    blocks of `ids[:-1]`. `keys(block_size)` are the keys of those blocks, first to last.
    """

    __slots__ = ("_keys", "count", "data", "hints")

    def __init__(self, ids: Sequence[int] | None = None, *, packed: bytes | None = None) -> None:
        """From token ids, or from ids already `pack`ed."""
        self.data = packed if packed is not None else pack(ids or ())
        self.count = len(self.data) // 4
        self._keys: dict[int, tuple[int, ...]] = {}
        # block size -> the last run of resident leading blocks an index found (a search hint)
        self.hints: dict[int, int] = {}

    @property
    def cacheable(self) -> int:
        return self.count - 1 if self.count > 0 else 0

    def keys(self, block_size: int) -> tuple[int, ...]:
        """Keys of the full blocks of the cacheable part at `block_size` tokens per block."""
        got = self._keys.get(block_size)
        if got is None:
            got = self._keys[block_size] = block_keys(self.data, self.cacheable, block_size)
        return got

    def key_at(self, base: int, tokens: int, extra: int) -> int:
        """The key `extra` tokens after the first `tokens` (whose key is `base`)."""
        view = memoryview(self.data)
        return extend(base, view[tokens * 4 : (tokens + extra) * 4])

    def ids(self) -> list[int]:
        arr = array("I")
        arr.frombytes(self.data)
        if sys.byteorder == "big":
            arr.byteswap()
        return arr.tolist()


def block_keys(data: bytes, tokens: int, block_size: int) -> tuple[int, ...]:
    """The key after each full block of the first `tokens` tokens packed in `data`."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    crc = zlib.crc32
    view = memoryview(data)
    step = block_size * 4
    h = 0
    out: list[int] = []
    append = out.append
    n = 0
    for start in range(0, (tokens // block_size) * step, step):
        h = crc(view[start : start + step], h)
        n += block_size
        append((n << 32) | h)
    return tuple(out)
