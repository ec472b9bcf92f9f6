"""The committed config generation: the one version of the config that every worker of a host runs.

The supervisor owns it: the config's text as it was read and checked, the secrets it resolved, its
number, and the probe epoch of each configured backend (`state.health_feed`). Nothing else is the
config: a worker that starts (the first time, or replacing one that died) builds from the committed
generation its hub hands it over its private channel, never from the file, which only a reload reads
(`propose`). So a file edited and not reloaded, or whose reload was refused, changes nothing until a
reload commits it, and a restarted worker always runs what its siblings run.

On the wire (the hub's 0700 Unix socket) the secrets travel resolved: a worker does not read the
environment or the key files again (they may have changed since the commit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr

from ..access.secrets import Secrets, resolve_secrets
from ..settings import ApiKey, Backend, ConfigError, Settings
from ..state.reload import Checked, ReloadRejected, check, read_config


@dataclass(frozen=True, slots=True)
class Committed:
    number: int
    text: str
    source: str  # the config file (or `<config>` for the embedded demo), for error messages
    settings: Settings
    secrets: Secrets
    epochs: dict[str, int] = field(default_factory=dict)  # configured backend -> its probe epoch

    @classmethod
    def first(cls, settings: Settings, *, text: str | None = None, source: str = "<config>",
              secrets: Secrets | None = None) -> Committed:
        """Generation 1: the config the supervisor started with (`text` as read; default: `settings`
        written out, as for the demo fleet)."""
        if text is None:
            text = yaml.safe_dump(settings.model_dump(mode="json"))
        if secrets is None:
            secrets = resolve_secrets(settings, source=source)
        return cls(1, text, source, settings, secrets, {b.name: 1 for b in settings.backends})

    def wire(self) -> dict[str, Any]:
        return {"number": self.number, "text": self.text, "source": self.source,
                "secrets": secrets_wire(self.secrets), "epochs": dict(self.epochs)}


@dataclass(frozen=True, slots=True)
class Received:
    """A committed generation as a worker receives it (its text not parsed yet: `check` does that)."""

    number: int
    text: str
    source: str
    secrets: Secrets
    epochs: dict[str, int]

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Received:
        return cls(int(body["number"]), str(body["text"]), str(body["source"]), secrets_from_wire(body["secrets"]),
                   {str(k): int(v) for k, v in body["epochs"].items()})

    def check(self) -> Checked:
        """The one validation every process makes (ConfigError), with the supervisor's secrets."""
        return check(self.text, source=self.source, secrets=self.secrets)


def secrets_wire(secrets: Secrets) -> dict[str, Any]:
    return {"api_keys": [k.model_dump(mode="json") for k in secrets.api_keys], "admin_digest": secrets.admin_digest,
            "backend_keys": {n: v.get_secret_value() for n, v in secrets.backend_keys.items()},
            "discovery_keys": {n: v.get_secret_value() for n, v in secrets.discovery_keys.items()}}


def secrets_from_wire(body: Mapping[str, Any]) -> Secrets:
    return Secrets(
        api_keys=tuple(ApiKey.model_validate(k) for k in body["api_keys"]),
        admin_digest=body["admin_digest"],
        backend_keys={str(n): SecretStr(str(v)) for n, v in body["backend_keys"].items()},
        discovery_keys={str(n): SecretStr(str(v)) for n, v in body["discovery_keys"].items()},
    )


def probe_epochs(old: Sequence[Backend], old_epochs: Mapping[str, int], new: Sequence[Backend],
                 number: int) -> dict[str, int]:
    """Each backend of generation `number`'s config: the epoch its probes belong to. A backend
    configured exactly as before keeps its epoch (its probes go on); a new or changed one starts
    epoch `number`."""
    before = {b.name: b for b in old}
    return {b.name: old_epochs.get(b.name, number) if before.get(b.name) == b else number for b in new}


def propose(current: Committed, path: str | Path) -> Committed:
    """Read and check the config file as the next generation (ReloadRejected: every problem found).
    Blocking (file reads, tokenizers): the hub runs it in a thread."""
    text = read_config(path)
    try:
        checked = check(text, source=str(path))
    except ConfigError as exc:
        raise ReloadRejected(exc.errors) from None
    number = current.number + 1
    epochs = probe_epochs(current.settings.backends, current.epochs, checked.settings.backends, number)
    return Committed(number, text, str(path), checked.settings, checked.secrets, epochs)
