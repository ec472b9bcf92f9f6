"""A deterministic tokenizer approximation shared by usage counts, `/tokenize` and the prefix caches.

Real tokenizers are not available offline, and the emulators only need three properties: roughly four
characters per token (so token counts scale like real ones), identical ids for identical text (so a
shared system prompt is a shared token prefix and hits the prefix cache), and a way back from ids to
text (`/detokenize`). Pieces are word-ish runs of at most four characters; the id is a stable hash.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

VOCAB_SIZE = 50_000
IM_START = 1
IM_END = 2
_SPECIAL = {"<|im_start|>": IM_START, "<|im_end|>": IM_END}
_FIRST_HASHED_ID = 1_000  # ids below are reserved for specials and the generated-text vocabulary
_PIECE = re.compile(r"<\|im_(?:start|end)\|>| ?[A-Za-z0-9]{1,4}|[A-Za-z0-9]{1,4}| ?[^\sA-Za-z0-9]|\s")

# Reverse map filled as text is tokenized, so `/detokenize` can return what `/tokenize` saw.
_ID_TO_PIECE: dict[int, str] = {v: k for k, v in _SPECIAL.items()}


def piece_id(piece: str) -> int:
    """The id of one piece: specials are fixed, everything else hashes into the upper vocabulary."""
    special = _SPECIAL.get(piece)
    if special is not None:
        return special
    h = zlib.crc32(piece.encode("utf-8"))
    return _FIRST_HASHED_ID + h % (VOCAB_SIZE - _FIRST_HASHED_ID)


def split(text: str) -> list[str]:
    """Split text into pieces whose concatenation is the text again."""
    return _PIECE.findall(text)


def encode(text: str) -> list[int]:
    ids = []
    for piece in split(text):
        tid = piece_id(piece)
        _ID_TO_PIECE.setdefault(tid, piece)
        ids.append(tid)
    return ids


def decode(ids: Iterable[int]) -> str:
    return "".join(_ID_TO_PIECE.get(i, "") for i in ids)


def remember(pieces: Sequence[str], ids: Sequence[int]) -> None:
    """Record generated pieces so their ids detokenize."""
    for p, i in zip(pieces, ids, strict=True):
        _ID_TO_PIECE.setdefault(i, p)


def content_text(content: Any) -> str:
    """The text of an OpenAI message `content`: a string or a list of `{"type":"text"}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def render_chat(messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
    """Render messages with a ChatML-like template, so that requests sharing a system prompt share a
    token prefix (the property prefix caches and prefix-affinity routing depend on)."""
    parts = [f"<|im_start|>{m.get('role', 'user')}\n{content_text(m.get('content'))}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
