"""A seeded, pure generator of MoE serving traffic for the routing benchmark.

Four patterns, mixed in one Poisson arrival stream (times are *simulated* seconds):

* **tenant chat**: every tenant has a long system prompt (1-4k tokens) shared by all its requests,
  followed by a short user question;
* **multi-turn sessions**: a conversation of one tenant whose prompt grows turn by turn (each turn
  appends the previous answer and a new question) and carries `x-session-id`; a pool of live
  conversations is advanced by the arrivals, so think time follows from the pool size;
* **RAG**: a few large documents, each reused by many requests (document first, then the question),
  with `x-prefix-key: doc-<i>` as a client that knows its document would send;
* **hot tenant**: optionally one tenant gets `hot_share` of the chat and session traffic.

Text is made of 3-letter words after a space, i.e. exactly 4 characters per token for the
emulators' tokenizer and the gateway's estimate. The previous answer of a session is synthesised
(the engine caches prompts, not its own outputs, so what matters is that the next turn's prompt
extends the previous prompt). Everything is a pure function of the spec, so every policy replays
byte-identical traffic.
"""

from __future__ import annotations

import itertools
import math
import random
import string
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    seed: int = 1
    rate_rps: float = 10.0  # Poisson arrival rate, simulated requests per second
    requests: int = 1000
    tenants: int = 24
    system_tokens: tuple[int, int] = (1000, 4000)
    docs: int = 12
    doc_tokens: tuple[int, int] = (3000, 6000)
    chat_share: float = 0.5  # the rest: sessions and RAG
    session_share: float = 0.3
    active_sessions: int = 32
    max_turns: int = 8
    question_tokens: tuple[int, int] = (20, 80)
    max_tokens: tuple[int, int] = (16, 48)
    hot_share: float = 0.0  # share of chat+session traffic of tenant 0 (0 = uniform tenants)
    sla_ttft_ms: float | None = None  # attached to a `sla_share` of the requests
    sla_share: float = 1.0

    def scaled(self, factor: float) -> WorkloadSpec:
        """The same mix with the working set (tenants, documents, live sessions) scaled by `factor`."""
        return replace(
            self,
            tenants=max(2, round(self.tenants * factor)),
            docs=max(1, round(self.docs * factor)),
            active_sessions=max(2, round(self.active_sessions * factor)),
        )


@dataclass(frozen=True, slots=True)
class TimedRequest:
    at_s: float  # arrival offset, simulated seconds
    messages: tuple[Mapping[str, str], ...]
    max_tokens: int
    headers: Mapping[str, str] = field(default_factory=dict)
    kind: str = "chat"  # chat | session | rag
    group: str = ""  # tenant or document: what shares the prefix
    session: str | None = None

    @property
    def prompt_chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages)

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_chars // CHARS_PER_TOKEN


def words(rng: random.Random, tokens: int) -> str:
    """`tokens` tokens of random 3-letter words (" abc" is one 4-character token)."""
    letters = string.ascii_lowercase
    return "".join(" " + "".join(rng.choices(letters, k=3)) for _ in range(tokens))


def shared_texts(text: random.Random, tenants: int, system_tokens: tuple[int, int], docs: int,
                 doc_tokens: tuple[int, int]) -> tuple[list[str], list[str], list[float]]:
    """What many requests share, drawn from `text` in this order: each tenant's system prompt, the
    documents, and the documents' cumulative Zipf weights (document d weighs 1/(d+1))."""
    systems = [f"You are the assistant of tenant {t}." + words(text, text.randint(*system_tokens))
               for t in range(tenants)]
    documents = [f"Document {d}." + words(text, text.randint(*doc_tokens)) for d in range(docs)]
    return systems, documents, list(itertools.accumulate(1.0 / (d + 1) for d in range(docs)))


@dataclass(slots=True)
class _Session:
    sid: str
    tenant: int
    history: list[dict[str, str]]
    turns: int = 0


def _tenant(rng: random.Random, spec: WorkloadSpec) -> int:
    if spec.hot_share > 0 and rng.random() < spec.hot_share:
        return 0
    return rng.randrange(spec.tenants)


def _question(rng: random.Random, spec: WorkloadSpec) -> str:
    return "Question:" + words(rng, rng.randint(*spec.question_tokens))


def generate(spec: WorkloadSpec) -> list[TimedRequest]:
    """The timed requests of `spec`, sorted by arrival time. Pure and seeded."""
    rng = random.Random(spec.seed)
    text_rng = random.Random(spec.seed * 7919 + 1)
    systems, docs, doc_weights = shared_texts(text_rng, spec.tenants, spec.system_tokens, spec.docs, spec.doc_tokens)
    sessions: list[_Session | None] = [None] * spec.active_sessions
    next_sid = 0
    out: list[TimedRequest] = []
    t = 0.0
    for _ in range(spec.requests):
        t += rng.expovariate(spec.rate_rps)
        max_tokens = rng.randint(*spec.max_tokens)
        headers: dict[str, str] = {}
        if spec.sla_ttft_ms is not None and rng.random() < spec.sla_share:
            headers["x-sla-ttft-ms"] = f"{spec.sla_ttft_ms:g}"
        u = rng.random()
        if u < spec.chat_share:
            tenant = _tenant(rng, spec)
            messages: tuple[Mapping[str, str], ...] = (
                {"role": "system", "content": systems[tenant]},
                {"role": "user", "content": _question(rng, spec)},
            )
            out.append(TimedRequest(t, messages, max_tokens, headers, "chat", f"tenant-{tenant}"))
        elif u < spec.chat_share + spec.session_share:
            slot = rng.randrange(spec.active_sessions)
            s = sessions[slot]
            if s is None or s.turns >= spec.max_turns:
                tenant = _tenant(rng, spec)
                s = _Session(f"sess-{spec.seed}-{next_sid}", tenant, [{"role": "system", "content": systems[tenant]}])
                next_sid += 1
                sessions[slot] = s
            s.history.append({"role": "user", "content": _question(rng, spec)})
            s.turns += 1
            messages = tuple(dict(m) for m in s.history)
            out.append(TimedRequest(t, messages, max_tokens, {**headers, "x-session-id": s.sid}, "session",
                                    f"tenant-{s.tenant}", s.sid))
            # What the next turn sends back as this turn's answer (synthesised: see the module doc).
            s.history.append({"role": "assistant", "content": "Answer:" + words(rng, max_tokens)})
        else:
            d = rng.choices(range(spec.docs), cum_weights=doc_weights)[0]  # Zipf(1): a few docs dominate
            messages = (
                {"role": "system", "content": "Answer from this document only.\n" + docs[d]},
                {"role": "user", "content": _question(rng, spec)},
            )
            out.append(TimedRequest(t, messages, max_tokens, {**headers, "x-prefix-key": f"doc-{d}"}, "rag",
                                    f"doc-{d}"))
    return out


def working_set_tokens(requests: list[TimedRequest]) -> int:
    """Distinct prompt tokens across `requests` (the KV a single infinite cache would end up holding),
    counted over 64-character blocks of the concatenated message contents."""
    seen: set[int] = set()
    for r in requests:
        text = "".join(m["content"] for m in r.messages)
        h = 0
        for start in range(0, len(text) - 63, 64):
            h = hash((h, text[start : start + 64]))
            seen.add(h)
    return len(seen) * 64 // CHARS_PER_TOKEN


def ideal_hit_rate(requests: list[TimedRequest]) -> float:
    """1 - distinct / total prompt tokens: the hit rate of one infinitely large cache (block-rounded)."""
    total = sum(r.prompt_tokens for r in requests)
    return 1.0 - working_set_tokens(requests) / total if total else math.nan
