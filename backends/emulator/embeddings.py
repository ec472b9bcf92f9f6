"""Deterministic embedding vectors and the runtimes' `/v1/embeddings` bodies (pure).

A vector is a feature-hashed bag of the input's token ids: every token adds +-1 to four
dimensions chosen by a hash of its id, and the sum is L2-normalised (as the runtimes normalise
pooled embeddings) and rounded to float32 (what they send). So identical inputs get identical
vectors and inputs that share tokens point in similar directions, cheaply (O(tokens), not
O(tokens x dim)). `base64` is the packed little-endian float32 array, as vLLM sends it.

Bodies (key order, nulls):
* vLLM 0.32 (captured, tests/emulator/captures/vllm-0.32.0-cpu/embeddings*.txt): `embd-` + 16 hex,
  data items `index, object, embedding`, usage with `completion_tokens: 0` and null details.
* SGLang (`srt/entrypoints/openai/protocol.py` `EmbeddingResponse`): `data, model, object, usage`, no
  id or created, data items `embedding, index, object`, usage as SGLang's `UsageInfo`.
* trtllm-serve (`openai_protocol.py` `EmbeddingResponse`, embedding-model role): `embd-` + 32 hex,
  usage `prompt_tokens, total_tokens` only.
"""

from __future__ import annotations

import base64
import functools
import math
import struct
import zlib
from collections.abc import Sequence
from typing import Any

from backends.emulator import tokenizer

_HASHES_PER_TOKEN = 4


class EmbeddingInputError(ValueError):
    """`input` is not a string, a list of strings, a list of ids or a list of id lists."""


def inputs(raw: Any) -> list[list[int]]:
    """Token ids of each input of an embeddings request (the four OpenAI forms)."""
    if isinstance(raw, str):
        return [tokenizer.encode(raw)]
    if isinstance(raw, list) and raw:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
            return [[int(x) for x in raw]]
        if all(isinstance(x, str) for x in raw):
            return [tokenizer.encode(x) for x in raw]
        if all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in raw):
            return [[int(t) for t in x] for x in raw]
    raise EmbeddingInputError("Input should be a string, a list of strings, a list of token ids or a list of "
                              "token-id lists.")


@functools.lru_cache(maxsize=65_536)
def _features(token: int, dim: int) -> tuple[tuple[int, float], ...]:
    out = []
    for k in range(_HASHES_PER_TOKEN):
        h = zlib.crc32(f"{token}:{k}".encode())
        out.append((h % dim, 1.0 if (h >> 31) & 1 else -1.0))
    return tuple(out)


def vector(tokens: Sequence[int], dim: int) -> list[float]:
    v = [0.0] * dim
    for t in tokens:
        for idx, sign in _features(t, dim):
            v[idx] += sign
    norm = math.sqrt(sum(x * x for x in v))
    if norm == 0.0:
        v[0], norm = 1.0, 1.0
    packed = struct.pack(f"<{dim}f", *(x / norm for x in v))
    return list(struct.unpack(f"<{dim}f", packed))


def encode(vec: Sequence[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    return list(vec)


Vectors = list[list[float] | str]


def vllm_body(rid: str, created: int, model: str, data: Vectors, prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "list", "created": created, "model": model,
        "data": [{"index": i, "object": "embedding", "embedding": e} for i, e in enumerate(data)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None, "completion_tokens_details": None},
    }


def sglang_body(model: str, data: Vectors, prompt_tokens: int) -> dict[str, Any]:
    return {
        "data": [{"embedding": e, "index": i, "object": "embedding"} for i, e in enumerate(data)],
        "model": model, "object": "list",
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None, "reasoning_tokens": 0},
    }


def trtllm_body(rid: str, created: int, model: str, data: Vectors, prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "list", "created": created, "model": model,
        "data": [{"index": i, "object": "embedding", "embedding": e} for i, e in enumerate(data)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
