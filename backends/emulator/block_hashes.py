"""Block hashes as each runtime computes them, so published KV events carry the runtime's integers.

* vLLM 0.32 (`vllm/v1/core/kv_cache_utils.py` `hash_block_tokens`, `vllm/utils/hashing.py` `sha256`,
  default `--prefix-caching-hash-algo sha256`): `sha256(pickle.dumps((parent, tuple(tokens), extra_keys),
  HIGHEST_PROTOCOL))`, chained on the parent's 32-byte digest; the first block's parent is
  `NONE_HASH = sha256(pickle.dumps("vllm-none-hash"))` (the fixed seed used when PYTHONHASHSEED is
  unset). Events carry the low 64 bits as an unsigned int (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`,
  the default). Verified equal to a real vLLM 0.32's events (tests/emulator/test_kv_encodings.py).
* SGLang (`srt/mem_cache/utils.py` `get_hash_str`, `hash_str_to_int64`): per page, `sha256(prior
  digest + each token as 4-byte little-endian)`, chained; events carry the first 8 bytes as a
  *signed* int64.
* TensorRT-LLM (`cpp/tensorrt_llm/batch_manager/kvCacheUtils` `BlockKeyHasher::hash`): a 64-bit mix
  over the block's tokens seeded with the parent's hash (0 for the first block); no LoRA, no extra
  token ids, no cache salt, no multimodal keys.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence

# A hasher: (tokens, block size) -> one hash per *full* block, chained from the first block.
Hasher = Callable[[Sequence[int], int], list[int]]

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
VLLM_NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()


def python_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The cheap default when no events are published: Python's tuple hash, chained."""
    keys, prev = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = hash((prev, tuple(tokens[start : start + block_size])))
        keys.append(prev)
    return keys


def vllm_digests(tokens: Sequence[int], block_size: int) -> list[bytes]:
    out: list[bytes] = []
    parent = VLLM_NONE_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        data = (parent, tuple(tokens[start : start + block_size]), None)
        parent = hashlib.sha256(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def vllm_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    return [int.from_bytes(d, "big") & _MASK64 for d in vllm_digests(tokens, block_size)]


def sglang_page_hashes(pages: Sequence[Sequence[int]], prior: bytes | None) -> list[tuple[int, bytes]]:
    """(event hash, digest) per page, chained from `prior` (the parent node's last page digest)."""
    out = []
    for page in pages:
        h = hashlib.sha256()
        if prior:
            h.update(prior)
        for t in page:
            h.update(int(t).to_bytes(4, "little", signed=False))
        prior = h.digest()
        value = int.from_bytes(prior[:8], "big")
        out.append((value - (1 << 64) if value >= 1 << 63 else value, prior))
    return out


def sglang_hashes(tokens: Sequence[int], page_size: int) -> list[int]:
    pages = [tokens[i : i + page_size] for i in range(0, len(tokens) - page_size + 1, page_size)]
    return [h for h, _ in sglang_page_hashes(pages, None)]


def _mix32(a: int) -> int:
    a = (((a >> 16) ^ a) * 0x45D9F3B) & _MASK32
    a = (((a >> 16) ^ a) * 0x45D9F3B) & _MASK32
    return (a >> 16) ^ a


def trtllm_block_hash(tokens: Sequence[int], parent: int) -> int:
    seed = (len(tokens) ^ ((parent * 0xBF58476D1CE4E5B9) & _MASK64)) & _MASK64
    for t in tokens:
        a = _mix32(int(t) & _MASK32)
        seed ^= (a + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64
        seed &= _MASK64
    return seed


def trtllm_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    out, parent = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = trtllm_block_hash(tokens[start : start + block_size], parent)
        out.append(parent)
    return out
