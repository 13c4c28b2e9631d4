"""Printing: rich tables for people, JSON for programs, errors on stderr.

rich is imported on first use (``console`` is a stand-in until then): a
command that prints JSON or nothing never pays for it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from krex.errors import KrexError

if TYPE_CHECKING:
    from rich.console import Console


class _LazyConsole:
    """``rich.console.Console`` made on first attribute access: a terminal's own width
    (or $COLUMNS); 120 columns into a pipe or file."""

    _real: Console | None = None

    def __getattr__(self, name: str) -> Any:
        if self._real is None:
            from rich.console import Console

            wide = sys.stdout.isatty() or "COLUMNS" in os.environ
            type(self)._real = Console(highlight=False, width=None if wide else 120)
        return getattr(self._real, name)


console: Any = _LazyConsole()

# The one --json flag: every command that has a table offers it through this parent parser.
JSON_OUTPUT = argparse.ArgumentParser(add_help=False)
JSON_OUTPUT.add_argument("--json", action="store_true",
                         help="machine-readable output: JSON on stdout instead of tables")


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A table that fits the terminal: headers and cells wrap, but the first column
    (the row's name: a mode, a job, a command) is never cut."""
    from rich import box
    from rich.table import Table

    cells = [["" if v is None else str(v) for v in row] for row in rows]
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for i, col in enumerate(columns):
        if i == 0:
            longest = max((len(r[0]) for r in cells if r), default=0)
            t.add_column(col, no_wrap=True, min_width=min(max(longest, len(col)), 40))
        else:  # wrap between words, never inside one
            t.add_column(col, min_width=max((len(w) for w in col.split()), default=1))
    for row in cells:
        t.add_row(*row)
    console.print(t)


def error(exc: KrexError | str, hint: str | None = None) -> None:
    if isinstance(exc, KrexError):
        hint = hint or exc.hint
        exc = exc.message
    text = f"krex: error: {exc}"
    if hint:
        text += f" (hint: {hint})"
    print(text, file=sys.stderr)


def ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f}"
