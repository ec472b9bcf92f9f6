"""One benchmark module run on its own (`python -m bench.routing ...`), parsed as `python -m bench
routing ...` parses it: the module's `add_arguments`, then its `run(args, argv)`."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

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


@contextlib.contextmanager
def progress_steps(total: int) -> Iterator[tuple[Callable[[str], None], Callable[[], None]]]:
    """A rich progress bar of `total` steps: `step(text)` names what runs now, `done()` advances."""
    with Progress(TextColumn("{task.description:<52}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn()) as progress:
        task = progress.add_task("", total=total)
        yield (lambda text: progress.update(task, description=text)), (lambda: progress.advance(task))
