"""A request body -> the engine's prompt token ids (`TokenPrompt`), tokenized once per text segment.

`tokenizers` splits its input on added tokens (`<|im_start|>`, `<|im_end|>`, ...) before it
normalises, pre-tokenizes and merges, so the text between two special tokens is tokenized on its
own. A chat template wraps every message in special tokens, so a conversation's messages are
separate segments: each distinct segment is tokenized once and kept (bounded LRU), and a
conversation that resends its whole history every turn only tokenizes its new messages.

That equivalence is checked when the tokenizer loads (`segment_safe`): added tokens that strip
whitespace around them, match normalised text, or a pre-tokenizer that prepends a marker only to
the very first word (Metaspace `prepend_scheme: first`) make segments depend on their neighbours;
such tokenizers are used on whole prompts, with a smaller whole-text cache instead.

As vLLM does: chat prompts are rendered with the chat template and tokenized without adding
special tokens (`add_special_tokens` defaults to false for chat), completions prompts with them
(the post-processor's prefix and suffix, e.g. a BOS, default true); token-id prompts are used as
they are; a batch of prompts is routed by its first.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

from tokenizers import Tokenizer

from backends.base import Endpoint

from ..routing.tokens import TokenPrompt, pack
from .chat import ChatTemplate, Unrenderable

# What the caches may hold, in bytes of packed token ids (4 per token): 16 MiB is 4M tokens, e.g.
# 2,000 conversations of 2,000 tokens of history each.
SEGMENT_CACHE_BYTES = 16 << 20
WHOLE_CACHE_BYTES = 4 << 20  # whole prompts, when segments cannot be tokenized apart


class PromptTokenizer(Protocol):
    """What the proxy calls once per request (pure, apart from its caches)."""

    name: str

    def prompt(self, body: Mapping[str, Any], endpoint: Endpoint) -> TokenPrompt | None:
        """The engine's prompt tokens for `body`, or None when they cannot be known exactly."""
        ...


class Lru:
    """Text -> packed token ids, least recently used first out, bounded by the bytes it holds."""

    __slots__ = ("_d", "bytes", "cap_bytes", "hits", "misses")

    def __init__(self, cap_bytes: int) -> None:
        self._d: OrderedDict[str, bytes] = OrderedDict()
        self.cap_bytes = cap_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> bytes | None:
        got = self._d.get(key)
        if got is not None:
            self._d.move_to_end(key)
            self.hits += 1
        else:
            self.misses += 1
        return got

    def put(self, key: str, packed: bytes) -> None:
        old = self._d.pop(key, None)
        if old is not None:
            self.bytes -= len(old) + len(key)
        self._d[key] = packed
        self.bytes += len(packed) + len(key)
        while self.bytes > self.cap_bytes and len(self._d) > 1:
            k, v = self._d.popitem(last=False)
            self.bytes -= len(v) + len(k)

    def __len__(self) -> int:
        return len(self._d)


def first_prompt(prompt: Any) -> Any:
    """A completions `prompt`: a batch is routed by its first prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt


def token_list(prompt: Any) -> list[int] | None:
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < 2**32 for t in prompt):
        return prompt
    return None


class HfPromptTokenizer:
    """A Hugging Face `tokenizer.json` (+ chat template) as the engine applies it."""

    def __init__(self, name: str, tokenizer: Tokenizer, template: ChatTemplate | None) -> None:
        self.name = name
        self._tok = tokenizer
        self.template = template
        added = tokenizer.get_added_tokens_decoder()
        self._special = {t.content: pack([i]) for i, t in added.items()}
        self.segment_safe = _segment_safe(tokenizer)
        self._split: re.Pattern[str] | None = None
        if self.segment_safe and self._special:
            alternatives = sorted(self._special, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")
        self.segments = Lru(SEGMENT_CACHE_BYTES)
        self.whole = Lru(WHOLE_CACHE_BYTES)
        plain = tokenizer.encode("a", add_special_tokens=False).ids
        full = tokenizer.encode("a", add_special_tokens=True).ids
        at = _find(full, plain)
        prefix, suffix = (full[:at], full[at + len(plain):]) if at >= 0 else ([], [])
        self._prefix, self._suffix = pack(prefix), pack(suffix)
        if self.segment_safe and not self._self_check():
            self.segment_safe, self._split = False, None

    def encode(self, text: str, *, add_special_tokens: bool) -> bytes:
        """`text`'s token ids, packed (`routing.tokens.pack`)."""
        if self._split is None:
            key = ("1" if add_special_tokens else "0") + text
            got = self.whole.get(key)
            if got is None:
                got = pack(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
                self.whole.put(key, got)
            return got
        out: list[bytes] = [self._prefix] if add_special_tokens else []
        append = out.append
        special = self._special
        segments = self.segments
        encode = self._tok.encode
        for piece in self._split.split(text):
            if not piece:
                continue
            sid = special.get(piece)
            if sid is not None:
                append(sid)
                continue
            got = segments.get(piece)
            if got is None:
                got = pack(encode(piece, add_special_tokens=False).ids)
                segments.put(piece, got)
            append(got)
        if add_special_tokens:
            append(self._suffix)
        return b"".join(out)

    def prompt(self, body: Mapping[str, Any], endpoint: Endpoint) -> TokenPrompt | None:
        if endpoint is Endpoint.CHAT:
            if self.template is None:
                return None
            try:
                text = self.template.render(body)
            except Unrenderable:
                return None
            add = bool(body.get("add_special_tokens", False))
            return TokenPrompt(packed=self.encode(text, add_special_tokens=add))
        prompt = first_prompt(body.get("prompt"))
        if isinstance(prompt, str):
            add = bool(body.get("add_special_tokens", True))
            return TokenPrompt(packed=self.encode(prompt, add_special_tokens=add))
        ids = token_list(prompt)
        return TokenPrompt(ids) if ids is not None else None

    def _self_check(self) -> bool:
        """Segment-wise tokenization equals whole-text tokenization on a sample with every kind of
        boundary (text, newline and space around special tokens)."""
        specials = list(self._special)[:3]
        if not specials:
            return True
        parts = ["Hello there, world.", "\n", " x y", "  leading spaces", "tail\n\n", "ab"]
        sample = "".join(p + specials[i % len(specials)] for i, p in enumerate(parts)) + " end"
        whole = pack(self._tok.encode(sample, add_special_tokens=False).ids)
        saved = self.segments
        self.segments = Lru(1 << 16)
        try:
            return self.encode(sample, add_special_tokens=False) == whole
        finally:
            self.segments = saved


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return -1


def _segment_safe(tokenizer: Tokenizer) -> bool:
    for token in tokenizer.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word or (token.normalized and tokenizer.normalizer is not None):
            return False
    config = tokenizer.to_str()
    return not re.search(r'"prepend_scheme"\s*:\s*"first"|"type"\s*:\s*"Prepend"', config)
