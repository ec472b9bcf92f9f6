from __future__ import annotations

import copy
from dataclasses import replace

from backends.base import Runtime
from gateway.settings import Backend, parse_settings
from gateway.stats import StatsBook

from .fixtures import SETTINGS, outcome, settings


def test_a_reload_adds_new_backends_and_keeps_the_history_of_existing_ones() -> None:
    book = StatsBook(settings(), started_at=0.0)
    book.record(outcome("v1", 10.5, completion=40))
    changed = copy.deepcopy(SETTINGS)
    changed["backends"] = [b for b in changed["backends"] if b["name"] != "t1"]
    changed["backends"].append({"name": "s2", "runtime": "sglang", "url": "http://127.0.0.1:9005", "model": "m",
                                "usd_per_hour": 12.0})
    changed["routes"][0]["backends"] = ["v1", "v2", "s1", "s2"]
    book.reconfigure(parse_settings(changed))
    assert set(book.backends) == {"v1", "v2", "s1", "s2"}
    assert "trtllm" not in book.runtimes
    assert book.runtimes["sglang"].backends == ("s1", "s2")
    assert book.prices["s2"] == 12.0
    assert book.backends["v1"].series.fine.get(10) is not None  # v1's history survived the reload
    assert book.backends["v1"].series.fine.get(10).completion_tokens == 40  # type: ignore[union-attr]
    book.record(replace(outcome("s2", 11.5, completion=7), runtime="sglang"))
    assert book.runtimes["sglang"].series.fine.get(11).completion_tokens == 7  # type: ignore[union-attr]


def test_discovered_backends_get_groups_while_in_the_pool_and_arms_naming_a_pool_follow_it() -> None:
    doc = copy.deepcopy(SETTINGS)
    doc["discovery"] = [{"name": "pool", "runtime": "sglang", "model": "m", "usd_per_hour": 8.0,
                         "dns": {"host": "pool.test", "port": 80}}]
    doc["routes"][1]["split"]["arms"][1]["backends"] = ["pool"]
    config = parse_settings(doc)
    book = StatsBook(config, started_at=0.0)
    joined = Backend(name="pool-127.0.0.2:80", runtime=Runtime.SGLANG, url="http://127.0.0.2:80", model="m",
                     usd_per_hour=8.0)
    book.reconfigure(config, backends=[*config.backends, joined], pools={"pool": [joined.name]})
    assert book.arms[("ab", "sglang")].backends == ("pool-127.0.0.2:80",)
    assert book.runtimes["sglang"].backends == ("s1", "pool-127.0.0.2:80")
    assert book.prices["pool-127.0.0.2:80"] == 8.0
    book.record(replace(outcome("pool-127.0.0.2:80", 10.5, completion=9), runtime="sglang"))
    book.reconfigure(config, backends=[*config.backends, joined], pools={"pool": [joined.name]})  # another joins
    assert book.backends["pool-127.0.0.2:80"].series.fine.get(10).completion_tokens == 9  # type: ignore[union-attr]
    book.reconfigure(config, backends=config.backends, pools={"pool": []})  # it left
    assert "pool-127.0.0.2:80" not in book.backends
    assert len(book.arms[("ab", "sglang")].backends) == 0
