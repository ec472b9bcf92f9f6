"""Rules for the modules mypyc compiles (setup.py's NATIVE), checked on their source.

No `await` (nor `async with`/`async for`) inside a `finally` or an `except` block: compiled by
mypyc 2.4, such a coroutine left the handled exception set after it had been dealt with, and a later
request on the same connection raised it again: the gateway closed that connection without an answer
(the Prometheus tier, a 500 from one backend, then "Server disconnected" for later streams; mypyc
issues 1114 and 1177 are of this family). The pure build never showed it, so only a rule on the
source keeps it out of the compiled one. Put such cleanup in an interpreted module
(`proxy.pairs.Pairs.around`) or after the handler (`proxy.relay`'s error tail).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def native_modules() -> list[str]:
    """setup.py's NATIVE list, read from its source (setup.py calls setup() when imported)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "NATIVE" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return [str(v) for v in value]
    raise AssertionError("setup.py has no NATIVE list")


def awaits_in_handlers(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Try | ast.TryStar):
            continue
        blocks = [("finally", node.finalbody)] + [("except", h.body) for h in node.handlers]
        for kind, body in blocks:
            for stmt in body:
                for sub in ast.walk(stmt):
                    if isinstance(sub, ast.Await | ast.AsyncWith | ast.AsyncFor):
                        found.append(f"line {sub.lineno}: in the {kind} of the try at line {node.lineno}")
    return found


def test_the_native_list_names_existing_modules() -> None:
    modules = native_modules()
    assert len(modules) > 20
    assert all((ROOT / m).is_file() for m in modules), [m for m in modules if not (ROOT / m).is_file()]


def test_no_compiled_module_awaits_in_a_finally_or_except_block() -> None:
    offending = {m: hits for m in native_modules() if (hits := awaits_in_handlers((ROOT / m).read_text()))}
    assert offending == {}


def test_the_rule_sees_each_form() -> None:
    source = """
async def f(x):
    try:
        await x
    except ValueError:
        await x
    finally:
        async with x:
            pass
    try:
        pass
    finally:
        async for _ in x:
            pass
    try:
        await x
    except KeyError:
        pass
"""
    assert awaits_in_handlers(source) == [
        "line 8: in the finally of the try at line 3",
        "line 6: in the except of the try at line 3",
        "line 13: in the finally of the try at line 10",
    ]
