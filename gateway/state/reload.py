"""Atomic config reload (SIGHUP or `POST /admin/reload`), in two phases.

`check` is the one validation of a config text, whoever makes it: `gateway check-config`, a process
starting, a reload, the supervisor of `--workers N` and each of its workers (tokenizers included, so
that nothing a worker would refuse passes the supervisor). Any problem rejects the config whole, with
one line per problem naming the field, and the running generation keeps serving.

A reload then runs in two phases on the same `Reloader`:

- **prepare**: build the new generation's parts (pool, proxy, poller) and nothing else: no task
  starts, nothing the app shares (discovery, live splits, KV intake, the comparison's backends)
  changes, so `abort` drops it without a trace;
- **commit**: the app adopts its parts (`activate`), the new pool is probed once, and it is swapped
  in by one assignment; requests already running finish on the generation they started with.

One process runs both at once (`reload`). Under `--workers N` the supervisor is the coordinator
(`cluster.hub`): every worker prepares the generation the supervisor checked, then every one commits
it, or every one aborts it. `listen` and `limits` are bound to sockets and the server at start-up: a
change there (or in `state`, the shared store) is reported as `restart_required` and takes effect on
the next start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..access.secrets import Secrets, resolve_secrets
from ..settings import ConfigError, Settings, settings_from_yaml
from ..tokenize import PromptTokenizer, resolve_tokenizers
from .generations import Generation, Generations

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Checked:
    """A config that passed `check`: what a generation is built from."""

    settings: Settings
    secrets: Secrets
    tokenizers: Mapping[str, PromptTokenizer]
    source: str  # where its text came from, for error messages


def check(text: str, *, source: str, secrets: Secrets | None = None) -> Checked:
    """Parse and validate a config's text, resolve its secrets (unless `secrets` are given: a worker
    takes the ones its supervisor resolved) and load its tokenizers. Raises ConfigError with every
    problem found."""
    settings = settings_from_yaml(text, source=source)
    resolved = secrets if secrets is not None else resolve_secrets(settings, source=source)
    return Checked(settings, resolved, resolve_tokenizers(settings, source=source), source)


def read_config(path: str | Path) -> str:
    """The config file's text (ReloadRejected when it cannot be read)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReloadRejected([f"<file>: cannot read {path}: {type(exc).__name__}"]) from None


Build = Callable[[Checked, int], Generation]  # the parts only (ConfigError)
Activate = Callable[[Generation], None]  # what the app shares adopts a generation's config


@dataclass(frozen=True, slots=True)
class Reloaded:
    generation: int
    restart_required: list[str]


def restart_required(old: Settings, new: Settings) -> list[str]:
    """The changed sections that only a restart applies (bound to sockets, the server or the store)."""
    return [k for k in RESTART_KEYS if getattr(old, k) != getattr(new, k)]


RESTART_KEYS = ("listen", "limits", "state", "tracing", "endpoint_picker")


class ReloadRejected(Exception):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


class Reloader:
    def __init__(
        self, generations: Generations, build: Build, config_path: str | Path | None, *,
        activate: Activate | None = None,
    ) -> None:
        self._generations = generations
        self._build = build
        self._activate = activate
        self._path = config_path
        self._lock = asyncio.Lock()

    async def reload(self) -> Reloaded:
        """Re-read the config file and reload it in this process (both phases)."""
        if self._path is None:
            raise ReloadRejected(["<config>: started without --config (demo fleet): nothing to reload"])
        async with self._lock:
            try:
                checked = check(read_config(self._path), source=str(self._path))
            except ConfigError as exc:
                log.warning("config reload rejected: %s", "; ".join(exc.errors))
                raise ReloadRejected(exc.errors) from None
            prepared = self.prepare(checked, self._generations.current.number + 1)
            return await self.commit(prepared)

    def prepare(self, checked: Checked, number: int) -> Generation:
        """Build generation `number` from a checked config, changing nothing else (ReloadRejected)."""
        try:
            return self._build(checked, number)
        except ConfigError as exc:
            log.warning("config reload rejected: %s", "; ".join(exc.errors))
            raise ReloadRejected(exc.errors) from None

    async def commit(self, generation: Generation) -> Reloaded:
        """Make a prepared generation the current one: the app adopts it, its pool is probed once,
        then it is installed (the previous one finishes its requests)."""
        old = self._generations.current
        if self._activate is not None:
            self._activate(generation)
        await generation.poller.poll_once()
        generation.start()
        self._generations.install(generation)
        restart = restart_required(old.settings, generation.settings)
        log.info("config reloaded: generation %d%s", generation.number,
                 f" (restart required for {', '.join(restart)})" if restart else "")
        return Reloaded(generation.number, restart)

    async def abort(self, generation: Generation) -> None:
        """Drop a prepared generation (nothing of it was started or shared)."""
        await generation.stop()
