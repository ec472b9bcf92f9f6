"""`tokenizer:` specs -> loaded tokenizers (I/O: reads files once, at start and on reload).

A spec is one of:

* `emulator`: the emulators' built-in tokenizer (`emulator.py`);
* a local directory holding `tokenizer.json` and, for chat, a chat template: `chat_template.jinja`
  (transformers' file since 4.43; it wins), `chat_template.json`, or `chat_template` in
  `tokenizer_config.json` (a string, or a list of named templates of which `default` is used);
  special tokens (`bos_token`, ...) come from `tokenizer_config.json`;
* a Hugging Face model name (`org/name`) already in the local Hugging Face cache
  (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`); nothing is downloaded.

Loaded tokenizers are kept by spec, so a reload does not parse them again and their segment caches
survive. A spec that cannot be loaded raises `TokenizerError` naming what is missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from ..settings import ConfigError, Settings
from .chat import ChatTemplate
from .emulator import NAME as EMULATOR
from .emulator import EmulatorPromptTokenizer
from .prompt import HfPromptTokenizer, PromptTokenizer

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_LOADED: dict[str, PromptTokenizer] = {}


class TokenizerError(ValueError):
    """A `tokenizer:` spec that cannot be loaded."""


def load(spec: str) -> PromptTokenizer:
    """The tokenizer named by `spec` (loaded once per process)."""
    got = _LOADED.get(spec)
    if got is None:
        got = _LOADED[spec] = EmulatorPromptTokenizer() if spec == EMULATOR else _load_hf(spec)
    return got


def _load_hf(spec: str) -> HfPromptTokenizer:
    directory = resolve(spec)
    try:
        tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as exc:  # the tokenizers library raises plain Exceptions for bad files
        raise TokenizerError(f"{spec}: cannot read {directory / 'tokenizer.json'}: {exc}") from exc
    config = _json(directory / "tokenizer_config.json") or {}
    special: dict[str, str] = {}
    for key in _SPECIAL_KEYS:
        text = _token_text(config.get(key))
        if text is not None:
            special[key] = text
    source = chat_template_source(directory, config)
    try:
        template = ChatTemplate(source, special_tokens=special) if source is not None else None
    except ValueError as exc:
        raise TokenizerError(f"{spec}: {exc}") from exc
    return HfPromptTokenizer(spec, tok, template)


def resolve(spec: str) -> Path:
    """The directory holding `spec`'s tokenizer files."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{spec}: no tokenizer.json in {path}")
        return path
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise TokenizerError(f"{spec}: not a directory, and not a Hugging Face name (org/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as exc:  # pragma: no cover - a dependency of tokenizers
        raise TokenizerError(f"{spec}: huggingface_hub is not installed") from exc
    try:
        found = Path(snapshot_download(spec, local_files_only=True, cache_dir=hf_cache_dir(),
                                       allow_patterns=["tokenizer.json", "tokenizer_config.json", "chat_template.*"]))
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise TokenizerError(f"{spec}: not in the local Hugging Face cache (nothing is downloaded): {exc}") from exc
    if not (found / "tokenizer.json").is_file():
        raise TokenizerError(f"{spec}: the cached snapshot {found} has no tokenizer.json")
    return found


def hf_cache_dir() -> str | None:
    """The Hugging Face hub cache, read from the environment now (the library reads it at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def chat_template_source(directory: Path, config: dict[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = _json(directory / "chat_template.json")
    raw = as_json.get("chat_template") if as_json else config.get("chat_template")
    if isinstance(raw, list):  # named templates
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default")
    return raw if isinstance(raw, str) else None


def _json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else None


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def resolve_tokenizers(settings: Settings, *, source: str = "<config>") -> dict[str, PromptTokenizer]:
    """Each route's tokenizer, by route model (routes without one are absent). Every spec that
    cannot be loaded is reported with its field path (ConfigError)."""
    errors: list[str] = []
    out: dict[str, PromptTokenizer] = {}
    where = {b.tokenizer: f"backends.{i}.tokenizer" for i, b in reversed(list(enumerate(settings.backends)))
             if b.tokenizer}
    for i, route in enumerate(settings.routes):
        spec = settings.route_tokenizer(route)
        if spec is None:
            continue
        try:
            out[route.model] = load(spec)
        except TokenizerError as exc:
            path = f"routes.{i}.tokenizer" if spec == route.tokenizer else where.get(spec, f"routes.{i}")
            line = f"{path}: {exc}"
            if line not in errors:
                errors.append(line)
    if errors:
        raise ConfigError(source, errors)
    return out
