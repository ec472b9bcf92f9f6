"""Limits are read once, at start, by both fronts: a reload that changes them says `restart_required`
and neither front applies them until the restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.harness import GatewayProcess

from .client import CHAT, Conn, assert_openai_error, chat
from .conftest import FRONTS, LIMITS, MAX_BODY, Fleet
from .test_messages import address, is_chat


@pytest.mark.parametrize("front", FRONTS)
def test_a_reload_that_changes_limits_needs_a_restart_on_both_fronts(
    front: str, fleet: Fleet, tmp_path: Path
) -> None:
    config: dict[str, Any] = {"listen": {"front": front}, "backends": fleet.entries(),
              "routes": [{"model": "moe", "backends": ["fast"]}], "limits": LIMITS}
    gw = GatewayProcess(config, tmp_path)
    try:
        between = {**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_BODY // 2)}]}  # old limit: fine
        over = {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({**config, "limits": {**LIMITS, "max_body_bytes": 1024}}))
        resp = gw.post("/admin/reload")
        assert resp.status_code == 200, resp.text
        assert resp.json()["restart_required"] == ["limits"]
        with Conn(address(gw)) as c:
            c.send(chat(between))
            assert is_chat(c.read_response())  # the start-up limit still holds
            c.send(chat(over))
            assert_openai_error(c.read_response(), 413, "request_too_large")
    finally:
        gw.stop()
