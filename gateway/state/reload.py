"""Atomic config reload (SIGHUP or `POST /admin/reload`).

The new config is read, validated and its secrets resolved; any problem rejects it whole, with one
line per problem naming the field, and the old generation keeps serving. A valid config becomes a new
generation, probed once, then swapped in by one assignment; requests already running finish on the
generation they started with. `listen` and `limits` are bound to sockets and the server at start-up:
a change there (or in `state`, the shared store) is reported as `restart_required` and takes effect on
the next start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..access.secrets import Secrets, resolve_secrets
from ..settings import ConfigError, Settings, load_settings
from .generations import Generation, Generations

log = logging.getLogger(__name__)

Build = Callable[[Settings, Secrets, int], Generation]


@dataclass(frozen=True, slots=True)
class Reloaded:
    generation: int
    restart_required: list[str]


def restart_required(old: Settings, new: Settings) -> list[str]:
    """The changed sections that only a restart applies (bound to sockets, the server or the store)."""
    return [k for k in RESTART_KEYS if getattr(old, k) != getattr(new, k)]


RESTART_KEYS = ("listen", "limits", "state")


class ReloadRejected(Exception):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


class Reloader:
    def __init__(self, generations: Generations, build: Build, config_path: str | Path | None) -> None:
        self._generations = generations
        self._build = build
        self._path = config_path
        self._lock = asyncio.Lock()

    async def reload(self) -> Reloaded:
        if self._path is None:
            raise ReloadRejected(["<config>: started without --config (demo fleet): nothing to reload"])
        async with self._lock:
            old = self._generations.current
            try:
                settings = load_settings(self._path)
                secrets = resolve_secrets(settings, source=str(self._path))
                new = self._build(settings, secrets, old.number + 1)  # ConfigError: e.g. a tokenizer not found
            except ConfigError as exc:
                log.warning("config reload rejected: %s", "; ".join(exc.errors))
                raise ReloadRejected(exc.errors) from None
            except OSError as exc:
                raise ReloadRejected([f"<file>: cannot read {self._path}: {type(exc).__name__}"]) from None
            await new.poller.poll_once()
            new.start()
            self._generations.install(new)
            restart = restart_required(old.settings, settings)
            log.info("config reloaded: generation %d%s", new.number,
                     f" (restart required for {', '.join(restart)})" if restart else "")
            return Reloaded(new.number, restart)
