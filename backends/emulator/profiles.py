"""Performance profiles: per-runtime engine parameters for one model on one machine.

Iteration time follows spec section 6.2:
`t_iter = t_fixed + max(W(B) + c_kv·Σctx, B·t_token) + prefill_tokens / prefill_rate`, where
`W(B) = w_base + w_moe·(1 - 0.75^B)` models a top-2-of-8 MoE touching more experts as the decode
batch grows. Every figure, its source and whether it is measured or estimated is in docs/emulator.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from backends.base import Runtime


class CacheKind(enum.StrEnum):
    BLOCK_HASH = "block_hash"  # vLLM, TensorRT-LLM
    RADIX = "radix"  # SGLang
    NONE = "none"  # prefix reuse disabled


@dataclass(frozen=True, slots=True)
class EngineParams:
    """One runtime's scheduler limits and cost model. Times are simulated seconds."""

    t_fixed_s: float
    w_base_s: float
    w_moe_s: float
    kv_read_s_per_token: float
    decode_s_per_token: float  # compute floor per decoded token at large batch
    prefill_tokens_per_s: float
    max_num_seqs: int
    max_batched_tokens: int
    kv_blocks: int
    block_size: int
    cache_kind: CacheKind


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    hardware: str
    gpus: int
    usd_per_gpu_hour: float
    default_output_tokens: int  # output length when a request sets no max_tokens
    runtimes: dict[Runtime, EngineParams]
    # P/D KV hand-off: a fixed cost (handshake, first RDMA round trip) plus a per-token cost
    # (KV bytes per token over the effective per-GPU link bandwidth; see docs/emulator.md)
    kv_transfer_fixed_s: float = 0.002
    kv_transfer_s_per_token: float = 1.5e-6

    def kv_transfer_s(self, tokens: int) -> float:
        """Simulated seconds to hand `tokens` tokens of KV from a prefill to a decode server."""
        return 0.0 if tokens <= 0 else self.kv_transfer_fixed_s + tokens * self.kv_transfer_s_per_token

    @property
    def usd_per_hour(self) -> float:
        return self.gpus * self.usd_per_gpu_hour


H100_USD_PER_HOUR = 10.0  # assumed on-demand price per GPU (see docs/emulator.md)
H200_USD_PER_HOUR = 12.0


def _kv_blocks(tokens: int, block: int) -> int:
    return tokens // block


# DeepSeek-V3/R1 671B FP8 on one 8xH200 node. ~0.5M KV tokens per TP group (spec 6.2b).
_DS_KV_TOKENS = 500_000
_DS_VLLM = EngineParams(
    t_fixed_s=0.010, w_base_s=0.020, w_moe_s=0.040, kv_read_s_per_token=1e-8, decode_s_per_token=0.30e-3,
    prefill_tokens_per_s=15_000, max_num_seqs=1024, max_batched_tokens=8192,
    kv_blocks=_kv_blocks(_DS_KV_TOKENS, 64), block_size=64, cache_kind=CacheKind.BLOCK_HASH,
)
_DS_SGLANG = EngineParams(
    t_fixed_s=0.006, w_base_s=0.008, w_moe_s=0.020, kv_read_s_per_token=1e-8, decode_s_per_token=0.12e-3,
    prefill_tokens_per_s=40_000, max_num_seqs=1024, max_batched_tokens=8192,
    kv_blocks=_DS_KV_TOKENS, block_size=1, cache_kind=CacheKind.RADIX,
)
_DS_TRTLLM = EngineParams(
    t_fixed_s=0.005, w_base_s=0.007, w_moe_s=0.019, kv_read_s_per_token=1e-8, decode_s_per_token=0.11e-3,
    prefill_tokens_per_s=30_000, max_num_seqs=2048, max_batched_tokens=8192,
    kv_blocks=_kv_blocks(_DS_KV_TOKENS, 32), block_size=32, cache_kind=CacheKind.BLOCK_HASH,
)
_DS_TRITON = replace(_DS_TRTLLM, kv_blocks=_kv_blocks(_DS_KV_TOKENS, 64), block_size=64, cache_kind=CacheKind.NONE)

# Mixtral 8x7B BF16 on 2xH100 SXM (TP2): ~390k KV tokens (spec 6.2a).
_MX_KV_TOKENS = 390_000
_MX_VLLM = EngineParams(
    t_fixed_s=0.003, w_base_s=0.002, w_moe_s=0.017, kv_read_s_per_token=2.8e-8, decode_s_per_token=0.026e-3,
    prefill_tokens_per_s=30_000, max_num_seqs=1024, max_batched_tokens=8192,
    kv_blocks=_kv_blocks(_MX_KV_TOKENS, 16), block_size=16, cache_kind=CacheKind.BLOCK_HASH,
)
_MX_SGLANG = EngineParams(
    t_fixed_s=0.0025, w_base_s=0.002, w_moe_s=0.016, kv_read_s_per_token=2.8e-8, decode_s_per_token=0.024e-3,
    prefill_tokens_per_s=32_000, max_num_seqs=1024, max_batched_tokens=8192,
    kv_blocks=_MX_KV_TOKENS, block_size=1, cache_kind=CacheKind.RADIX,
)
_MX_TRTLLM = EngineParams(
    t_fixed_s=0.002, w_base_s=0.0013, w_moe_s=0.0114, kv_read_s_per_token=2.0e-8, decode_s_per_token=0.018e-3,
    prefill_tokens_per_s=45_000, max_num_seqs=2048, max_batched_tokens=8192,
    kv_blocks=_kv_blocks(_MX_KV_TOKENS, 32), block_size=32, cache_kind=CacheKind.BLOCK_HASH,
)
_MX_TRITON = replace(_MX_TRTLLM, kv_blocks=_kv_blocks(_MX_KV_TOKENS, 64), block_size=64, cache_kind=CacheKind.NONE)

# A tiny, fast profile for tests: small limits so queueing and KV pressure appear with few requests.
_TINY_VLLM = EngineParams(
    t_fixed_s=0.002, w_base_s=0.001, w_moe_s=0.004, kv_read_s_per_token=1e-7, decode_s_per_token=0.1e-3,
    prefill_tokens_per_s=100_000, max_num_seqs=16, max_batched_tokens=2048,
    kv_blocks=2048, block_size=16, cache_kind=CacheKind.BLOCK_HASH,
)
_TINY_SGLANG = replace(_TINY_VLLM, kv_blocks=32_768, block_size=1, cache_kind=CacheKind.RADIX)
_TINY_TRTLLM = replace(_TINY_VLLM, kv_blocks=1024, block_size=32)
_TINY_TRITON = replace(_TINY_VLLM, kv_blocks=512, block_size=64, cache_kind=CacheKind.NONE)

PROFILES: dict[str, Profile] = {
    "deepseek-v3-8xh200": Profile(
        name="deepseek-v3-8xh200", hardware="8x H200 141GB", gpus=8, usd_per_gpu_hour=H200_USD_PER_HOUR,
        default_output_tokens=256, kv_transfer_fixed_s=0.002, kv_transfer_s_per_token=1.4e-6,
        runtimes={Runtime.VLLM: _DS_VLLM, Runtime.SGLANG: _DS_SGLANG, Runtime.TRTLLM: _DS_TRTLLM,
                  Runtime.TRITON: _DS_TRITON},
    ),
    "mixtral-8x7b-h100": Profile(
        name="mixtral-8x7b-h100", hardware="2x H100 SXM 80GB", gpus=2, usd_per_gpu_hour=H100_USD_PER_HOUR,
        default_output_tokens=256, kv_transfer_fixed_s=0.002, kv_transfer_s_per_token=1.3e-6,
        runtimes={Runtime.VLLM: _MX_VLLM, Runtime.SGLANG: _MX_SGLANG, Runtime.TRTLLM: _MX_TRTLLM,
                  Runtime.TRITON: _MX_TRITON},
    ),
    "tiny": Profile(
        name="tiny", hardware="none (test profile)", gpus=1, usd_per_gpu_hour=1.0, default_output_tokens=16,
        kv_transfer_fixed_s=0.001, kv_transfer_s_per_token=1e-6,
        runtimes={Runtime.VLLM: _TINY_VLLM, Runtime.SGLANG: _TINY_SGLANG, Runtime.TRTLLM: _TINY_TRTLLM,
                  Runtime.TRITON: _TINY_TRITON},
    ),
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown emulator profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
