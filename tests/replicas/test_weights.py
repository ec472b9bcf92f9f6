"""Live A/B weights are one setting for the fleet: a change on one replica is in force on every
replica within a second, on every worker of each, and survives a replica's restart. Writes are
ordered by versions Redis issues: a replica's clock does not matter, and a write that loses is told
so (409) rather than answered 200 and reverted."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import Emulators, GatewayProcess, backend_entry, wait_for

from .conftest import Replicas
from .redis_server import RedisServer


def split_config(emulators: Emulators, vllm_weight: float = 50) -> dict[str, Any]:
    v, s = emulators.start("vllm"), emulators.start("sglang")
    return {
        "backends": [backend_entry("v", v, "vllm"), backend_entry("s", s, "sglang")],
        "routes": [{"model": "ab", "split": {"arms": [{"name": "vllm", "weight": vllm_weight, "backends": ["v"]},
                                                      {"name": "sglang", "weight": 50, "backends": ["s"]}]}}],
        "health": {"interval_s": 0.5},
    }


def weights(gw: GatewayProcess) -> dict[str, float]:
    with httpx.Client(timeout=10) as client:
        found: dict[str, float] = client.get(gw.url + "/admin/routes/ab/weights").json()["weights"]
        return found


def put(gw: GatewayProcess, **arms: float) -> httpx.Response:
    with httpx.Client(timeout=30) as client:
        return client.put(gw.url + "/admin/routes/ab/weights", json={"weights": arms})


def test_a_change_on_one_replica_is_in_force_on_all_within_a_second(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    cfg = split_config(emulators)
    a, b = replicas(cfg, 2, redis=redis)
    (c,) = replicas(cfg, 1, redis=redis, workers=2)  # and on every worker of a supervised replica
    changed = time.monotonic()
    assert put(a, vllm=10, sglang=90).status_code == 200
    target = {"vllm": 10.0, "sglang": 90.0}
    for gw in (b, c):
        wait_for(lambda gw=gw: weights(gw), lambda w: w == target, timeout=5, what="the new weights")  # type: ignore[misc]
    took = time.monotonic() - changed
    assert took < 1.0, f"{took:.2f} s to reach every replica"
    assert all(weights(c) == target for _ in range(10))  # whichever worker answers
    # the other way round, and a second change supersedes the first
    assert put(c, vllm=70, sglang=30).status_code == 200
    for gw in (a, b):
        wait_for(lambda gw=gw: weights(gw), lambda w: w == {"vllm": 70.0, "sglang": 30.0}, timeout=5,  # type: ignore[misc]
                 what="the second change")


def test_shared_weights_survive_a_replica_restart(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    cfg = split_config(emulators)
    a, b = replicas(cfg, 2, redis=redis)
    assert put(a, vllm=5, sglang=95).status_code == 200
    wait_for(lambda: weights(b), lambda w: w == {"vllm": 5.0, "sglang": 95.0}, timeout=5, what="b has the change")
    a.stop()
    b.stop()
    (fresh,) = replicas(cfg, 1, redis=redis)  # a new process: the file says 50/50, the fleet says 5/95
    assert weights(fresh) == {"vllm": 5.0, "sglang": 95.0}  # in force from its first request on


def test_a_replica_whose_split_differs_keeps_its_own_weights(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    (a,) = replicas(split_config(emulators), 1, redis=redis)
    (other,) = replicas(split_config(emulators, vllm_weight=20), 1, redis=redis)  # another experiment
    (same,) = replicas(split_config(emulators), 1, redis=redis)
    assert put(a, vllm=1, sglang=99).status_code == 200
    wait_for(lambda: weights(same), lambda w: w == {"vllm": 1.0, "sglang": 99.0}, timeout=5, what="same split")
    assert weights(other) == {"vllm": 20.0, "sglang": 50.0}


SKEWED_CLOCK = '''"""A machine whose clock is {offset} s ahead (a test double of a skewed host clock: the replica's
whole Python process reads this time; nothing in the gateway knows)."""
import time

_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + {offset}
time.time_ns = lambda: _time_ns() + {offset} * 1_000_000_000
'''


@contextlib.contextmanager
def skewed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offset_s: int) -> Iterator[None]:
    """Start gateways inside this context on a host whose clock is `offset_s` ahead."""
    site = tmp_path / f"clock-{offset_s}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SKEWED_CLOCK.format(offset=offset_s))
    with monkeypatch.context() as patch:
        patch.setenv("PYTHONPATH", str(site))
        yield


def stays(gw: GatewayProcess, target: dict[str, float], seconds: float) -> None:
    """Every read for `seconds` (several sync intervals) answers `target`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert weights(gw) == target


def test_a_change_on_a_replica_whose_clock_is_behind_is_not_reverted(
    emulators: Emulators, redis: RedisServer, replicas: Replicas, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Writes are ordered by versions Redis issues, not by the replicas' clocks: `ahead` runs a
    minute fast, and a change made on `behind` after `ahead`'s is the one in force everywhere."""
    cfg = split_config(emulators)
    with skewed(tmp_path, monkeypatch, 60):
        (ahead,) = replicas(cfg, 1, redis=redis)
    (behind,) = replicas(cfg, 1, redis=redis, workers=2)
    assert put(ahead, vllm=10, sglang=90).status_code == 200
    wait_for(lambda: weights(behind), lambda w: w == {"vllm": 10.0, "sglang": 90.0}, timeout=10,
             what="the first change")
    assert put(behind, vllm=70, sglang=30).status_code == 200
    target = {"vllm": 70.0, "sglang": 30.0}
    wait_for(lambda: weights(ahead), lambda w: w == target, timeout=10, what="the later change on the other replica")
    for gw in (behind, ahead):
        stays(gw, target, seconds=1.0)  # five sync intervals: not reverted


def test_a_change_made_on_an_old_version_is_refused_with_the_winner(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    """`late` reads the shared weights only every 10 s, so its change is made on the version before
    `first`'s: it loses, is told so (409, OpenAI's error shape plus the winning record), and
    `first`'s weights are in force on it: a 200 is never given and then undone."""
    cfg = split_config(emulators)
    (first,) = replicas(cfg, 1, redis=redis)
    (late,) = replicas(cfg, 1, redis=redis, workers=2, sync_interval_s=10)
    assert put(first, vllm=15, sglang=85).status_code == 200
    refused = put(late, vllm=60, sglang=40)
    assert refused.status_code == 409
    body = refused.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "weights_conflict"
    assert body["record"]["weights"] == {"vllm": 15.0, "sglang": 85.0}
    assert body["record"]["by"] == "replica-0"
    winner = {"vllm": 15.0, "sglang": 85.0}
    assert all(weights(late) == winner for _ in range(6))  # on whichever worker answers
    assert weights(first) == winner
    again = put(late, vllm=60, sglang=40)  # made now on the winner's version: it stands
    assert again.status_code == 200
    wait_for(lambda: weights(first), lambda w: w == {"vllm": 60.0, "sglang": 40.0}, timeout=10, what="the retry")
