"""The multi-turn workload of `bench multiturn` (pure, seeded).

16 tenants, each with a long system prompt; conversations of 4-8 turns that resend their whole
history every turn (system prompt, every question and every answer so far); 10% RAG requests over
a few shared documents (Zipf). A pool of live conversations is advanced by Poisson arrivals; a
finished conversation is replaced by a new one of a random tenant. Answers in the history are
synthesised (the engine caches prompts, so what matters is that turn n+1's prompt extends turn n's).

Text is 3-letter words after a space: exactly one token per word for the emulators' tokenizer and
the gateway's 4-characters estimate alike. The arrival rate is calibrated afterwards
(`calibrate`): the prefill a single infinite cache would still have to do, over the run, is
`load` x the fleet's prefill capacity.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from bench.workload import TimedRequest, shared_texts, words


@dataclass(frozen=True, slots=True)
class MultiTurnSpec:
    seed: int = 17
    requests: int = 2000
    tenants: int = 16
    system_tokens: tuple[int, int] = (1000, 3000)
    docs: int = 12
    doc_tokens: tuple[int, int] = (2000, 4000)
    rag_share: float = 0.10
    active_sessions: int = 96
    turns: tuple[int, int] = (4, 8)
    question_tokens: tuple[int, int] = (30, 120)
    answer_tokens: tuple[int, int] = (16, 64)  # the synthesised previous answer resent in the history
    max_tokens: tuple[int, int] = (4, 8)  # what each request generates


def generate(spec: MultiTurnSpec) -> list[TimedRequest]:
    """The requests at rate 1 (simulated request/s); `calibrate` scales the arrival times."""
    rng = random.Random(spec.seed)
    text = random.Random(spec.seed * 7919 + 3)
    systems, docs, doc_weights = shared_texts(text, spec.tenants, spec.system_tokens, spec.docs, spec.doc_tokens)
    sessions: list[tuple[str, int, list[dict[str, str]], int] | None] = [None] * spec.active_sessions
    made = 0
    t = 0.0
    out: list[TimedRequest] = []
    for _ in range(spec.requests):
        t += rng.expovariate(1.0)
        max_tokens = rng.randint(*spec.max_tokens)
        question = "Question:" + words(rng, rng.randint(*spec.question_tokens))
        if rng.random() < spec.rag_share:
            d = rng.choices(range(spec.docs), cum_weights=doc_weights)[0]
            messages: tuple[Mapping[str, str], ...] = (
                {"role": "system", "content": "Answer from this document only.\n" + docs[d]},
                {"role": "user", "content": question},
            )
            out.append(TimedRequest(t, messages, max_tokens, {"x-prefix-key": f"doc-{d}"}, "rag", f"doc-{d}"))
            continue
        slot = rng.randrange(spec.active_sessions)
        s = sessions[slot]
        if s is None or s[3] <= 0:
            tenant = rng.randrange(spec.tenants)
            s = (f"conv-{spec.seed}-{made}", tenant, [{"role": "system", "content": systems[tenant]}],
                 rng.randint(*spec.turns))
            made += 1
        sid, tenant, history, left = s
        history.append({"role": "user", "content": question})
        out.append(TimedRequest(t, tuple(dict(m) for m in history), max_tokens, {"x-session-id": sid}, "session",
                                f"tenant-{tenant}", sid))
        history.append({"role": "assistant", "content": "Answer:" + words(rng, rng.randint(*spec.answer_tokens))})
        sessions[slot] = (sid, tenant, history, left - 1)
    return out


def _prompt_text(r: TimedRequest) -> str:
    """The emulators' rendering (ChatML), whose tokens are what the engine caches."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in r.messages)
    return body + "<|im_start|>assistant\n"


def _blocks(r: TimedRequest, block: int) -> list[int]:
    from backends.emulator import tokenizer

    ids = [tokenizer.piece_id(p) for p in tokenizer.split(_prompt_text(r))]
    keys, h = [], 0
    for start in range(0, len(ids) - 1 - block + 1, block):  # the last prompt token is never cached
        h = hash((h, tuple(ids[start : start + block])))
        keys.append(h)
    return keys


@dataclass(frozen=True, slots=True)
class Ideal:
    """What one infinitely large cache would do with the workload (engine block granularity)."""

    prompt_tokens: int
    cached_tokens: int
    working_set_tokens: int  # distinct cacheable blocks, in tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def ideal(requests: Sequence[TimedRequest], block: int) -> Ideal:
    from backends.emulator import tokenizer

    seen: set[int] = set()
    prompt = cached = 0
    for r in requests:
        n = len(tokenizer.split(_prompt_text(r)))
        keys = _blocks(r, block)
        run = 0
        while run < len(keys) and keys[run] in seen:
            run += 1
        seen.update(keys)
        prompt += n
        cached += run * block
    return Ideal(prompt, cached, len(seen) * block)


def calibrate(requests: Sequence[TimedRequest], ideal_: Ideal, *, load: float,
              fleet_prefill_tokens_per_s: float) -> tuple[list[TimedRequest], float]:
    """Arrivals scaled so the ideal cache's remaining prefill is `load` x the fleet's prefill rate
    over the run; returns the requests and the rate (simulated requests/s)."""
    span = requests[-1].at_s  # at rate 1
    rate = load * fleet_prefill_tokens_per_s * span / ideal_.uncached_tokens
    return [replace(r, at_s=r.at_s / rate) for r in requests], rate
