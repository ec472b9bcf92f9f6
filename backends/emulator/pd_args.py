"""The P/D role of an emulator from its command line and environment, as each runtime reads it (pure).

* vLLM: `--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_both", ...}'`
  (`kv_role` kv_producer -> prefill, kv_consumer -> decode, kv_both -> both; `engine_id`,
  `kv_load_failure_policy`, `kv_connector_extra_config.shared_storage_path` for ExampleConnector),
  and the environment's `VLLM_NIXL_SIDE_CHANNEL_HOST`, `VLLM_NIXL_SIDE_CHANNEL_PORT` (5600) and
  `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` (480 s).
* SGLang: `--disaggregation-mode null|prefill|decode` and `--disaggregation-bootstrap-port` (8998),
  and `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` / `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` (300 s).
* Every runtime: the emulator's own `--role prefill|decode|both`. Given with a runtime's own flag,
  both must agree (`--role prefill` narrows `kv_both`; it may not contradict `kv_consumer`); given
  alone it implies the runtime's default connector (vLLM: NixlConnector). Neither: no P/D.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

from backends.base import Runtime
from backends.emulator.config import DisaggConfig, Role

KV_ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
SGLANG_MODES: dict[str, Role] = {"null": "both", "prefill": "prefill", "decode": "decode"}
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
DEFAULT_SIDE_CHANNEL_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default


def _agree(explicit: Role | None, implied: Role, source: str) -> Role:
    if explicit is None or explicit == implied:
        return implied
    if implied == "both":
        return explicit  # a role narrows what a kv_both server / null mode would do
    raise ValueError(f"--role {explicit} contradicts {source}")


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    try:
        return default if raw is None or raw == "" else float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def disagg_config(
    runtime: Runtime, *, role: str | None, kv_transfer_config: str | None = None,
    disaggregation_mode: str | None = None, bootstrap_port: int | None = None, env: Mapping[str, str] | None = None,
) -> DisaggConfig | None:
    """The DisaggConfig these flags and this environment describe (None: an aggregated server)."""
    env = env or {}
    explicit = cast(Role, role) if role is not None else None
    if explicit is not None and explicit not in ("prefill", "decode", "both"):
        raise ValueError(f"--role must be prefill, decode or both, not {role!r}")
    if runtime is Runtime.VLLM:
        return _vllm(explicit, kv_transfer_config, env)
    if kv_transfer_config is not None:
        raise ValueError("--kv-transfer-config is vLLM's")
    if runtime is Runtime.SGLANG:
        return _sglang(explicit, disaggregation_mode, bootstrap_port, env)
    if disaggregation_mode is not None or bootstrap_port is not None:
        raise ValueError("--disaggregation-mode and --disaggregation-bootstrap-port are SGLang's")
    if explicit is None:
        return None
    if runtime is Runtime.TRITON:
        raise ValueError("--role: the Triton face is aggregated only")
    return DisaggConfig(role=explicit, kv_lease_s=60.0)  # trtllm: an assumed kv_transfer_timeout_ms


def _vllm(explicit: Role | None, raw: str | None, env: Mapping[str, str]) -> DisaggConfig | None:
    if raw is None and explicit is None:
        return None
    cfg: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    if raw is not None:
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        cfg = parsed
    kv_role = cfg.get("kv_role")
    if kv_role not in KV_ROLES:
        raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, not {kv_role!r}")
    role = _agree(explicit, KV_ROLES[kv_role], f"kv_role {kv_role}") if raw is not None else cast(Role, explicit)
    extra = cfg.get("kv_connector_extra_config") or {}
    policy = cfg.get("kv_load_failure_policy", "recompute")
    if policy not in ("recompute", "fail"):
        raise ValueError(f"kv_load_failure_policy must be recompute or fail, not {policy!r}")
    port = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    return DisaggConfig(
        role=role, connector=str(cfg.get("kv_connector") or "NixlConnector"),
        engine_id=cfg.get("engine_id"), shared_storage_path=extra.get("shared_storage_path"),
        load_failure_policy=policy, side_channel_host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or None,
        side_channel_port=int(port) if port else DEFAULT_SIDE_CHANNEL_PORT,
        kv_lease_s=_float(env, "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", 480.0),
    )


def _sglang(explicit: Role | None, mode: str | None, port: int | None, env: Mapping[str, str]) -> DisaggConfig | None:
    if mode is None and explicit is None:
        return None
    if mode is not None and mode not in SGLANG_MODES:
        raise ValueError(f"--disaggregation-mode must be null, prefill or decode, not {mode!r}")
    role = _agree(explicit, SGLANG_MODES[mode], f"--disaggregation-mode {mode}") if mode else cast(Role, explicit)
    return DisaggConfig(
        role=role, bootstrap_port=DEFAULT_BOOTSTRAP_PORT if port is None else port,
        bootstrap_timeout_s=_float(env, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0),
        waiting_timeout_s=_float(env, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0),
    )
