"""Argument parsing and dispatch for ``krex``.

Start-up is on every agent command's path, so ``main`` imports and builds only
the subcommand it runs (``COMMANDS`` says in which module each lives); the
whole parser is built for ``krex --help`` and for a name that is not a
command (argparse then lists the choices).  ``krex --version`` imports
nothing but ``krex.version``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import TYPE_CHECKING

from krex.version import __version__

if TYPE_CHECKING:
    from krex.errors import KrexError

# name -> (module, function that adds its subparser).  Order: as `krex --help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("krex.cli.daemon_cmds", "add_serve"),
    "stop": ("krex.cli.daemon_cmds", "add_stop"),
    "status": ("krex.cli.daemon_cmds", "add_status"),
    "doctor": ("krex.cli.daemon_cmds", "add_doctor"),
    "run": ("krex.cli.job_cmds", "add_run"),
    "region": ("krex.cli.job_cmds", "add_region"),
    "exec": ("krex.cli.job_cmds", "add_exec"),
    "bench": ("krex.cli.bench_cmds", "add_bench"),
    "demo": ("krex.cli.demo", "add_demo"),
    "eval": ("krex.cli.eval_cmds", "add_eval"),
    "cluster": ("krex.cli.cluster_cmds", "add_cluster"),
    "evaluate": ("krex.cli.evaluate_cmds", "add_evaluate"),
    "history": ("krex.cli.evaluate_cmds", "add_history"),
    "service": ("krex.cli.service_cmds", "add_service"),
    "mcp": ("krex.cli.service_cmds", "add_mcp"),
}


def build_parser(serve_flags: bool = True, only: str | None = None) -> argparse.ArgumentParser:
    """The CLI: every command, or ``only`` that one.  ``serve_flags=False`` leaves out
    ``krex serve``'s flags (they come from the daemon's configuration, which a client
    command does not import)."""
    parser = argparse.ArgumentParser(
        prog="krex", description="Concurrent kernel benchmarking on shared GPUs."
    )
    parser.add_argument("--version", action="version", version=f"krex {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, function) in COMMANDS.items():
        if only is not None and name != only:
            continue
        add = getattr(importlib.import_module(module), function)
        if name == "serve":
            add(sub, with_flags=serve_flags)
        else:
            add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):
        print(f"krex {__version__}")
        return 0
    first = argv[0] if argv else None
    only = first if first in COMMANDS else None
    args = build_parser(serve_flags=first == "serve", only=only).parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Call the command; a :class:`~krex.errors.KrexError` becomes its exit code."""
    from krex.errors import CommandNotFound, CommandTimeout, KrexError, RegionTimeout, UsageError

    try:
        return int(args.func(args) or 0)
    except (RegionTimeout, CommandTimeout) as exc:
        _error(exc)
        return 124
    except UsageError as exc:
        _error(exc)
        return 2
    except CommandNotFound as exc:
        _error(exc)
        return exc.exit_status
    except KrexError as exc:
        _error(exc)
        return 1
    except KeyboardInterrupt:
        return 130


def _error(exc: KrexError) -> None:
    from krex.cli.output import error

    error(exc)


if __name__ == "__main__":
    sys.exit(main())
