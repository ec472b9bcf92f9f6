"""A reload across the workers of a host, in two phases (the hub is the coordinator).

1. The hub reads the file and checks it with the one validation every process uses
   (`state.reload.check`, tokenizers included) as the next generation (`committed.propose`); a
   problem there refuses the reload before any worker hears of it.
2. **Prepare**: every worker that is serving builds that generation from the text and secrets it is
   sent (`check` again, then the generation's parts, changing nothing: `state.reload.Reloader`).
   Any refusal, failure or silence (`PREPARE_TIMEOUT_S`) aborts it on every worker, and the hub
   changes nothing of its own: its committed generation, its probes, its weights stay as they were.
3. **Commit**: the hub commits first (the generation, then its probes: new backends are probed once
   before any worker switches), then tells every worker to commit. A worker that had not prepared
   (it was still starting) builds it then; one that cannot, exits and is started again from the
   committed generation, as any worker that dies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..state.reload import ReloadRejected
from .channel import Channel
from .committed import Committed, propose

log = logging.getLogger(__name__)

PREPARE_TIMEOUT_S = 60.0  # loading tokenizers takes a while
COMMIT_TIMEOUT_S = 120.0  # a worker that had not prepared builds then; the new pool is probed once


class Worker(Protocol):
    @property
    def slot(self) -> int: ...

    @property
    def channel(self) -> Channel: ...


async def ask(workers: Sequence[Worker], method: str, body: Any, *, timeout_s: float) -> list[tuple[Worker, Any]]:
    """Ask `workers` at once; a worker that fails or is gone answers its exception."""
    answers = await asyncio.gather(*(w.channel.call(method, body, timeout_s=timeout_s) for w in workers),
                                   return_exceptions=True)
    return list(zip(workers, answers, strict=True))


def refusals(answers: list[tuple[Worker, Any]]) -> list[str]:
    """One line per problem, naming the worker."""
    errors: list[str] = []
    for worker, answer in answers:
        if isinstance(answer, BaseException):
            errors.append(f"worker {worker.slot}: {type(answer).__name__}: {answer}")
        elif isinstance(answer, dict) and answer.get("errors"):
            errors += [f"worker {worker.slot}: {e}" for e in answer["errors"]]
    return errors


async def prepare(workers: Sequence[Worker], proposal: Committed) -> list[str]:
    return refusals(await ask(workers, "prepare", proposal.wire(), timeout_s=PREPARE_TIMEOUT_S))


async def abort(workers: Sequence[Worker], proposal: Committed) -> None:
    await ask(workers, "abort", proposal.number, timeout_s=PREPARE_TIMEOUT_S)


async def commit(workers: Sequence[Worker], proposal: Committed) -> list[str]:
    return refusals(await ask(workers, "commit", proposal.wire(), timeout_s=COMMIT_TIMEOUT_S))


async def reload(
    current: Committed, path: str | Path, commit_here: Callable[[Committed], Awaitable[None]],
    serving: Callable[[], Sequence[Worker]],
) -> Committed:
    """Both phases, coordinated: the committed generation (ReloadRejected, with every problem, when
    the hub or any worker refused it; then nothing changed anywhere). `serving()`: the workers that
    take part (asked again for the commit: one may have attached meanwhile)."""
    try:
        proposal = await asyncio.to_thread(propose, current, path)  # file and tokenizers: off the hub's loop
        voters = list(serving())
        errors = await prepare(voters, proposal)
        if errors:
            await abort(voters, proposal)
            raise ReloadRejected(errors)
    except ReloadRejected as exc:
        log.warning("config reload rejected: %s", "; ".join(exc.errors))
        raise
    await commit_here(proposal)
    failed = await commit(list(serving()), proposal)
    if failed:
        log.error("generation %d not committed everywhere (those workers restart from it): %s", proposal.number,
                  "; ".join(failed))
    return proposal
