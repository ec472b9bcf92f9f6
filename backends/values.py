"""Values between layers, and the one way to write those that every request builds.

`@value`: a frozen dataclass for the type checker, as cheap to build as a mutable one.
`@dataclass(frozen=True)` assigns each field through `object.__setattr__`: building a ten-field
instance costs ~1.2 µs here against ~0.2 µs for a plain slots dataclass. Classes decorated with
`@value` are frozen where it is checked (mypy rejects any assignment, see PEP 681
`frozen_default`), hashable and comparable by value, and at run time plain slots dataclasses.

On the request path (the modules `setup.py` compiles) a class built per request is written instead
as a dataclass with its `__init__` spelled out, its fields `Final` where they are never reassigned:

    @dataclass(slots=True, unsafe_hash=True)
    class Usage:
        prompt_tokens: Final[int]
        cached_tokens: Final[int | None]

        def __init__(self, prompt_tokens: int, cached_tokens: int | None = None) -> None:
            self.prompt_tokens = prompt_tokens
            self.cached_tokens = cached_tokens

mypyc compiles only the methods written in the source: a dataclass's generated `__init__` stays an
interpreted function (~400 ns a call), and a class under a decorator it does not know (`@value`)
is not a native class at all, so each of its attribute reads is a dictionary lookup. Written out,
the `__init__` is a C function (~45 ns), the class a native struct, and a `Final` field read-only in
the compiled build. The dataclass still derives `__eq__`, `__hash__`, `__repr__` and
`dataclasses.replace` from the annotations, so both builds behave alike (`__init__` takes every
field, under its name, for `replace`). `tests/unit/gateway/test_values.py` checks each such class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True)
def value(cls: type[T]) -> type[T]:
    return dataclass(slots=True, unsafe_hash=True)(cls)
