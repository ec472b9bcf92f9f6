"""An OpenAI-compatible gateway over pooled vLLM, SGLang and TensorRT-LLM backends."""

__version__ = "0.1.0"
