"""An OpenAI-compatible gateway over pooled vLLM, SGLang and TensorRT-LLM backends."""

from .build_check import check as _check_native_build

__version__ = "0.1.0"

_check_native_build()
