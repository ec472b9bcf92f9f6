from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Dnsmasq


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp_path)
    yield server
    server.stop()
