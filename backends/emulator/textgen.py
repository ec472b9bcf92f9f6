"""Deterministic "generated" text: what each emulated request will say, decided before it runs.

Deciding the whole output up front (pieces, length, finish reason, matched stop string) keeps the
engine a pure token counter and makes every response reproducible from the seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from backends.emulator import tokenizer

_WORDS = (
    " the", " sea", " book", " ship", " whale", " wave", " storm", " sail", " captain", " island",
    " deep", " blue", " tide", " harbor", " crew", " map", " star", " night", " wind", " shore",
    " and", " of", " a", " to", " in", " is", " was", " it", " that", " for", ".", ",",
    " read", " story", " novel", " author", " old", " man", " light", " house", " journey", " long",
)
_WORD_IDS = tuple(range(100, 100 + len(_WORDS)))
tokenizer.remember(_WORDS, _WORD_IDS)


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """What one choice will emit: one piece per token; `finish_reason` is "stop" or "length"."""

    pieces: tuple[str, ...]
    token_ids: tuple[int, ...]
    finish_reason: str
    stop_reason: str | None  # the matched stop string, None for EOS or length


def plan_output(
    rng: random.Random, *, max_tokens: int | None, default_tokens: int, stop: Sequence[str] = ()
) -> OutputPlan:
    """Plan an output: exactly `max_tokens` tokens ("length") when given, else a natural stop after
    about `default_tokens`; the first stop string to appear ends it early (vLLM trims the stop)."""
    if max_tokens is not None:
        n, reason = max_tokens, "length"
    else:
        n, reason = max(1, rng.randint(default_tokens // 2, default_tokens)), "stop"
    picks = [rng.randrange(len(_WORDS)) for _ in range(n)]
    pieces = [_WORDS[i] for i in picks]
    ids = [_WORD_IDS[i] for i in picks]
    if stop:
        text = ""
        for k, p in enumerate(pieces):
            text += p
            for s in stop:
                if s and s in text:
                    # Stop inside this piece: keep the text before the stop, emit k+1 tokens.
                    keep = text[: text.index(s)]
                    before = "".join(pieces[:k])
                    last = keep[len(before) :] if len(keep) >= len(before) else ""
                    new_pieces = (*pieces[:k], last)
                    return OutputPlan(new_pieces, tuple(ids[: k + 1]), "stop", s)
    return OutputPlan(tuple(pieces), tuple(ids), reason, None)


def plan_text(text: str, *, max_tokens: int | None) -> OutputPlan:
    """Plan an output that says exactly `text` (a constrained output: JSON or a tool call), one
    tokenizer piece per token, then EOS ("stop"); cut after `max_tokens` tokens ("length")."""
    pieces = tokenizer.split(text) or [""]
    ids = [tokenizer.piece_id(p) for p in pieces]
    tokenizer.remember(pieces, ids)
    if max_tokens is not None and len(pieces) > max_tokens:
        return OutputPlan(tuple(pieces[: max(1, max_tokens)]), tuple(ids[: max(1, max_tokens)]), "length", None)
    return OutputPlan(tuple(pieces), tuple(ids), "stop", None)
