from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.integration.harness import Emulators, LoopThread

from .stack import COUNTED, WARM_UP_S, WORKERS, ServedGateway, Tally, drive, fleet_config
from .tools import Prometheus, binaries, unix_time, until


@dataclass
class Stack:
    prometheus: Prometheus
    gateway: ServedGateway
    tally: Tally  # every request, warm-up included
    warm_scrape: float  # Prometheus's timestamp of the first scrape after the warm-up
    counted: int  # requests sent after that scrape
    last_scrape: float  # Prometheus's timestamp of the first scrape after all traffic had ended


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Start everything, drive the load, and wait until Prometheus has scraped the gateway after it
    (and evaluated its rules once more). Torn down by pid at the end of the module."""
    bin_dir = binaries()
    workdir = tmp_path_factory.mktemp("prometheus-tier")
    loop = LoopThread()
    emulators = Emulators(loop)
    gateway = prometheus = None
    try:
        gateway = ServedGateway(fleet_config(emulators), workdir, workers=WORKERS)
        prometheus = Prometheus(bin_dir, workdir, target=gateway.address)
        up = f'up{{job="{prometheus.job}"}}'
        until(lambda: prometheus.scalar(up) == 1, timeout=30, what="the first scrape of the gateway")

        def scrape_after(moment: float) -> float:
            return until(lambda: (t := prometheus.scalar(f"timestamp({up})")) is not None and t > moment and t,
                         timeout=30, what="a scrape after the load")

        tally = Tally()
        drive(gateway.url + "/v1", tally, seconds=WARM_UP_S)
        warm_scrape = scrape_after(tally.ended_at + 0.5)  # the gateway records just after the last byte
        warm_sent = tally.sent
        drive(gateway.url + "/v1", tally, at_least=COUNTED)
        last = scrape_after(tally.ended_at + 0.5)
        until(lambda: all(unix_time(g["lastEvaluation"]) > last for g in prometheus.api("rules")["groups"]),
              timeout=30, what="a rule evaluation after that scrape")
        yield Stack(prometheus, gateway, tally, warm_scrape, tally.sent - warm_sent, last)
    finally:
        if prometheus is not None:
            prometheus.stop()
        if gateway is not None:
            gateway.stop()
        emulators.stop_all()
        loop.close()
