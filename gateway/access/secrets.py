"""Secrets resolved from the environment and files at start-up and on every reload.

The config holds only references (an environment variable's name, a file's path) and digests. What
they resolve to lives here, as `SecretStr` (its `repr` is `SecretStr('**********')`), and reaches the
network only in `CredentialedAdapter.build_request`, i.e. only on requests to its own backend.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import yaml
from pydantic import SecretStr, TypeAdapter, ValidationError

from backends.base import (
    Adapter,
    ClientRequest,
    UpstreamRequest,
)
from backends.delegating import DelegatingAdapter

from ..settings import ApiKey, ConfigError, Settings, format_validation_error, parse_digest


def hash_key(key: str) -> str:
    """The digest a config stores for a client key or admin token (`gateway hash-key`)."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Secrets:
    api_keys: tuple[ApiKey, ...] = ()
    admin_digest: str | None = None
    backend_keys: dict[str, SecretStr] = field(default_factory=dict)
    discovery_keys: dict[str, SecretStr] = field(default_factory=dict)  # by entry: one key for its backends


def resolve_secrets(settings: Settings, *, source: str = "<config>") -> Secrets:
    """Read every referenced secret; all problems are reported together, each with its field path."""
    errors: list[str] = []
    auth = settings.auth
    keys = list(auth.api_keys)
    if auth.api_keys_file is not None:
        try:
            data = yaml.safe_load(Path(auth.api_keys_file).read_text(encoding="utf-8")) or []
            keys += TypeAdapter(list[ApiKey]).validate_python(data)
        except (OSError, yaml.YAMLError) as exc:
            errors.append(f"auth.api_keys_file: cannot read {auth.api_keys_file}: {type(exc).__name__}")
        except ValidationError as exc:
            errors += [f"auth.api_keys_file: {line}" for line in format_validation_error(exc)]
    ids = [k.id for k in keys]
    if len(set(ids)) != len(ids):
        errors.append("auth.api_keys_file: key ids must be unique across api_keys and api_keys_file")
    routes = {r.model for r in settings.routes}
    for key in keys:
        if set(key.models or ()) - routes:
            errors.append(f"auth.api_keys_file: key {key.id!r} names unknown route models")
    admin = auth.admin_token_sha256
    if auth.admin_token_file is not None:
        try:
            text = Path(auth.admin_token_file).read_text(encoding="utf-8").strip()
            admin = parse_digest(text) if text.lower().startswith("sha256:") else hash_key(text)
            if not text:
                raise ValueError("empty")
        except (OSError, ValueError) as exc:
            errors.append(f"auth.admin_token_file: cannot use {auth.admin_token_file}: {type(exc).__name__}")
    backend_keys = _upstream_keys("backends", settings.backends, errors)
    discovery_keys = _upstream_keys("discovery", settings.discovery, errors)
    if errors:
        raise ConfigError(source, errors)
    return Secrets(api_keys=tuple(keys), admin_digest=admin, backend_keys=backend_keys,
                   discovery_keys=discovery_keys)


class _KeyReference(Protocol):
    """A static backend or a discovery entry: a name and where its upstream key is."""

    @property
    def name(self) -> str: ...

    @property
    def api_key_env(self) -> str | None: ...

    @property
    def api_key_file(self) -> Path | None: ...


def _upstream_keys(section: str, items: Sequence[_KeyReference], errors: list[str]) -> dict[str, SecretStr]:
    found: dict[str, SecretStr] = {}
    for i, b in enumerate(items):
        if b.api_key_env is not None:
            value = os.environ.get(b.api_key_env)
            if not value:
                errors.append(f"{section}.{i}.api_key_env: environment variable {b.api_key_env} is not set")
            else:
                found[b.name] = SecretStr(value)
        elif b.api_key_file is not None:
            try:
                value = Path(b.api_key_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                errors.append(f"{section}.{i}.api_key_file: cannot read {b.api_key_file}: {type(exc).__name__}")
                continue
            if not value:
                errors.append(f"{section}.{i}.api_key_file: {b.api_key_file} is empty")
            found[b.name] = SecretStr(value)
    return found


class CredentialedAdapter(DelegatingAdapter):
    """An adapter that adds its backend's `Authorization: Bearer` header to every request it builds.

    The proxy sends only the headers the adapter builds, so the client's own Authorization header is
    never forwarded, and this key reaches only this backend."""

    def __init__(self, inner: Adapter, api_key: SecretStr) -> None:
        super().__init__(inner)
        self._api_key = api_key

    def __repr__(self) -> str:
        return f"CredentialedAdapter({self._inner!r}, api_key=SecretStr('**********'))"

    def build_request(self, req: ClientRequest, *, model: str, request_id: str) -> UpstreamRequest:
        upstream = self._inner.build_request(req, model=model, request_id=request_id)
        headers = {k: v for k, v in upstream.headers.items() if k.lower() != "authorization"}
        headers["Authorization"] = "Bearer " + self._api_key.get_secret_value()
        return dataclasses.replace(upstream, headers=headers)
