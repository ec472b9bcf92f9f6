"""The proxy's view of one configured route: its policy, its live A/B split, its decision counter,
its tokenizer."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..routing import Policy
from ..settings import Route
from ..state.splits import LiveSplit
from ..tokenize import PromptTokenizer


@dataclass(slots=True)
class RouteState:
    config: Route
    policy: Policy
    split: LiveSplit | None = None
    seq: Iterator[int] = field(default_factory=itertools.count)
    tokenizer: PromptTokenizer | None = None  # how the route's engines tokenize (exact prefix prediction)
