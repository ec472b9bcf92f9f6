"""One place that maps a configured runtime to its adapter (the composition root calls this)."""

from __future__ import annotations

from backends.base import Adapter, Runtime
from backends.sglang import SGLangAdapter
from backends.triton import TritonAdapter
from backends.trtllm import TRTLLMAdapter
from backends.vllm import VLLMAdapter


def adapter_for(runtime: Runtime, *, chat_template: str = "chatml") -> Adapter:
    """The adapter for `runtime`. `chat_template` only matters for Triton (raw-text prompts)."""
    match Runtime(runtime):
        case Runtime.VLLM:
            return VLLMAdapter()
        case Runtime.SGLANG:
            return SGLangAdapter()
        case Runtime.TRTLLM:
            return TRTLLMAdapter()
        case Runtime.TRITON:
            return TritonAdapter(chat_template=chat_template)
