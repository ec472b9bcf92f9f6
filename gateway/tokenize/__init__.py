"""Tokenize like the engine: a request -> the prompt token ids the engine will compute.

`loader.load(spec)` gives a `PromptTokenizer` for a `tokenizer:` spec (a local directory with
`tokenizer.json` and a chat template, a Hugging Face name already in the local cache, or
`emulator`); its `prompt(body, endpoint)` renders chat messages with the model's chat template
(`chat.py`, jinja2 as transformers does) and tokenizes with the `tokenizers` library, caching
segments between special tokens (`prompt.py`) so a conversation's history is tokenized once.
Used by the proxy once per request, for exact prefix-cache prediction (`gateway/kvcache`).

May import: `routing.tokens` (the value it produces), `settings`, `backends` (the emulators' tokenizer).
"""

from .loader import TokenizerError, load, resolve_tokenizers
from .prompt import PromptTokenizer

__all__ = ["PromptTokenizer", "TokenizerError", "load", "resolve_tokenizers"]
