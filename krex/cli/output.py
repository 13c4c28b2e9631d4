"""Printing: rich tables for people, JSON for programs, errors on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from krex.errors import KrexError

console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)

# The one --json flag: every command that has a table offers it through this parent parser.
JSON_OUTPUT = argparse.ArgumentParser(add_help=False)
JSON_OUTPUT.add_argument("--json", action="store_true",
                         help="machine-readable output: JSON on stdout instead of tables")


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col)
    for row in rows:
        t.add_row(*("" if v is None else str(v) for v in row))
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
