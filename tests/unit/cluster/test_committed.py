"""The committed generation's pure parts: probe epochs across reloads, secrets on the wire, live
splits kept only by a commit."""

from __future__ import annotations

from pydantic import SecretStr

from gateway.access.secrets import Secrets, hash_key
from gateway.cluster.committed import Committed, Received, probe_epochs, secrets_from_wire, secrets_wire
from gateway.settings import ApiKey, Backend, parse_settings
from gateway.state.splits import Splits


def backend(name: str, port: int = 1, **extra: object) -> Backend:
    return Backend.model_validate({"name": name, "runtime": "vllm", "url": f"http://127.0.0.1:{port}", "model": "m",
                                   **extra})


def test_an_unchanged_backend_keeps_its_epoch_a_new_or_changed_one_starts_one() -> None:
    old = [backend("same"), backend("moved"), backend("repriced"), backend("dropped")]
    epochs = {"same": 1, "moved": 2, "repriced": 1, "dropped": 1}
    new = [backend("same"), backend("moved", port=2), backend("repriced", usd_per_hour=3.0), backend("added")]
    assert probe_epochs(old, epochs, new, 5) == {"same": 1, "moved": 5, "repriced": 5, "added": 5}
    assert probe_epochs(new, {"same": 1, "moved": 5, "repriced": 5, "added": 5}, new, 6) == {
        "same": 1, "moved": 5, "repriced": 5, "added": 5}


def test_resolved_secrets_survive_the_wire() -> None:
    secrets = Secrets(api_keys=(ApiKey(id="team", key=hash_key("sk-team"), requests_per_minute=5),),
                      admin_digest=hash_key("admin"), backend_keys={"a": SecretStr("sk-a")},
                      discovery_keys={"pool": SecretStr("sk-pool")})
    back = secrets_from_wire(secrets_wire(secrets))
    assert back.api_keys == secrets.api_keys
    assert back.admin_digest == secrets.admin_digest
    assert {k: v.get_secret_value() for k, v in back.backend_keys.items()} == {"a": "sk-a"}
    assert {k: v.get_secret_value() for k, v in back.discovery_keys.items()} == {"pool": "sk-pool"}


def test_a_worker_receives_the_committed_text_not_the_file() -> None:
    settings = parse_settings({"backends": [backend("a").model_dump(mode="json")],
                               "routes": [{"model": "m", "backends": ["a"]}]})
    first = Committed.first(settings)
    received = Received.from_wire(first.wire())
    assert (received.number, received.epochs) == (1, {"a": 1})
    assert received.check().settings == settings


def test_a_prepared_split_is_kept_only_once_its_generation_commits() -> None:
    route = parse_settings({
        "backends": [backend("a").model_dump(mode="json"), backend("b").model_dump(mode="json")],
        "routes": [{"model": "ab", "split": {"arms": [{"name": "x", "weight": 1, "backends": ["a"]},
                                                      {"name": "y", "weight": 1, "backends": ["b"]}]}}],
    }).routes[0]
    splits = Splits()
    live = splits.for_route(route)
    splits.keep({"ab": live})
    live.set_weights({"x": 9})
    assert route.split is not None
    changed = route.model_copy(update={"split": route.split.model_copy(update={"salt": "other"})})
    prepared = splits.for_route(changed)  # a reload being prepared changes the split ...
    assert prepared is not live
    assert splits.for_route(route) is live  # ... and until it commits, the live one (and its weights) stays
    assert splits.for_route(route).weights == {"x": 9.0, "y": 1.0}
    splits.keep({"ab": prepared})
    assert splits.for_route(changed) is prepared
