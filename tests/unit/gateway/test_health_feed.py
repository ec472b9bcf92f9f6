"""What a worker's pools take of the supervisor's probe results: each result once, only from its own
epoch for each backend, never a stale round (no sockets)."""

from __future__ import annotations

from backends.base import Load
from backends.registry import adapter_for
from gateway.settings import Backend
from gateway.state.health_feed import Finding, FollowedPoller, ProbeFeed
from gateway.state.pool import BackendState, Pool


def pool(*names: str, url: str = "http://127.0.0.1:1") -> Pool:
    states = []
    for name in names:
        config = Backend.model_validate({"name": name, "runtime": "vllm", "url": url, "model": "m"})
        states.append(BackendState(config=config, adapter=adapter_for(config.runtime)))
    return Pool(states)


class NoProbes:
    async def poll_once(self) -> None: ...

    async def poll_backend(self, state: BackendState) -> None: ...

    async def run(self) -> None: ...


def ready(backend: str, round: int, epoch: int, ok: bool) -> list[object]:
    return Finding("ready", backend, round, epoch, ok=ok, error=None if ok else "refused").wire()


def follower(p: Pool, feed: ProbeFeed, epochs: dict[str, int]) -> FollowedPoller:
    f = FollowedPoller(p, feed, lambda: 100.0, NoProbes(), epochs)
    feed.follow(f)
    return f


def test_findings_survive_the_wire() -> None:
    for found in (Finding("ready", "a", 3, 2, ok=False, error="readiness probe answered 503"),
                  Finding("load", "a", 4, 2, load=Load(running=3, waiting=1, kv_usage=0.5), max_model_len=4096),
                  Finding("load", "a", 5, 2)):
        assert Finding.from_wire(found.wire()) == found


def test_a_pool_takes_only_the_findings_of_its_own_epoch() -> None:
    feed = ProbeFeed()
    p = pool("a", "b")
    follower(p, feed, {"a": 1, "b": 3})  # b's config changed in generation 3
    feed.publish([ready("b", 1, 1, False)])  # about b's old address
    assert p["b"].probe_ok
    feed.publish([ready("a", 2, 1, False), ready("b", 3, 3, False)])
    assert not p["a"].probe_ok
    assert not p["b"].probe_ok


def test_a_stale_round_is_dropped() -> None:
    feed = ProbeFeed()
    p = pool("a")
    follower(p, feed, {"a": 1})
    feed.publish([ready("a", 5, 1, False)])
    feed.publish([ready("a", 4, 1, True)])  # older than what the feed has
    assert not p["a"].probe_ok
    assert feed.latest("a")[0].round == 5


async def test_a_new_generation_starts_from_the_latest_findings_of_its_epochs_only() -> None:
    feed = ProbeFeed()
    feed.publish([ready("a", 1, 1, False), ready("b", 2, 1, False), ready("gone", 3, 1, True)])
    p = pool("a", "b")
    new = FollowedPoller(p, feed, lambda: 100.0, NoProbes(), {"a": 1, "b": 2})  # b re-configured at 2
    await new.poll_once()
    assert not p["a"].probe_ok
    assert p["b"].probe_ok  # the old address's "down" is not the new one's
    feed.retain({"a", "b"})  # committed: the dropped backend is forgotten
    assert feed.latest("gone") == []


def test_load_findings_set_the_load_and_the_context_length() -> None:
    feed = ProbeFeed()
    p = pool("a")
    follower(p, feed, {"a": 1})
    feed.publish([Finding("load", "a", 1, 1, load=Load(running=7), max_model_len=2048).wire()])
    assert p["a"].load.running == 7
    assert p["a"].max_model_len == 2048
