"""One benchmark module run on its own (`python -m bench.routing ...`), parsed as `python -m bench
routing ...` parses it: the module's `add_arguments`, then its `run(args, argv)`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace, list[str]], int]


def standalone(prog: str, doc: str | None, add_arguments: AddArguments, run: Run,
               argv: Sequence[str] | None = None) -> int:
    """The exit status of `run` on `argv` (default: the command line); `run` also gets the words
    themselves, which reports quote as the command that made them."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(words), words)
