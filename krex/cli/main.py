"""Argument parsing and dispatch for ``krex``.

Start-up is on every agent command's path, so ``main`` imports and builds only
the subcommand it runs (``COMMANDS`` says in which module each lives); the
whole parser is built for ``krex --help`` and for a name that is not a
command (argparse then lists the choices).  ``krex --version`` imports
nothing but ``krex.version``; a plain ``krex exec`` or ``krex status`` takes
the lean path (:mod:`krex.cli.lean`: no argparse, no dataclasses, no rich).
"""

from __future__ import annotations

import sys

from krex.version import __version__

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up cost)
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from typing import Any

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
    "kernelbench": ("krex.cli.kernelbench_cmds", "add_kernelbench"),
    "service": ("krex.cli.service_cmds", "add_service"),
    "mcp": ("krex.cli.service_cmds", "add_mcp"),
}


def build_parser(serve_flags: bool = True, only: str | None = None) -> argparse.ArgumentParser:
    """The CLI: every command, or ``only`` that one.  ``serve_flags=False`` leaves out
    ``krex serve``'s flags (they come from the daemon's configuration, which a client
    command does not import)."""
    import argparse
    import importlib

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


EXIT_SIGPIPE = 128 + 13  # as a shell reports a command killed by SIGPIPE


def main(argv: list[str] | None = None) -> int:
    """Run ``krex argv…``; a reader that went away (``krex … | head``) ends it quietly."""
    try:
        code = _main(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """stdout's reader closed the pipe: say nothing (the reader chose to stop), and send
    what is left in stdout's buffer nowhere so that exit does not fail on it again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_SIGPIPE


def _main(argv: list[str]) -> int:
    if argv[:1] in (["--version"], ["-V"]):
        print(f"krex {__version__}")
        return 0
    if argv[:1] in (["exec"], ["status"]):
        from krex.cli import lean

        code = _guarded(lean.run, argv)
        if code is not None:
            return code
    first = argv[0] if argv else None
    only = first if first in COMMANDS else None
    args = build_parser(serve_flags=first == "serve", only=only).parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Call the command; a :class:`~krex.errors.KrexError` becomes its exit code."""
    return int(_guarded(args.func, args) or 0)


def _guarded(command: Callable[[Any], int | None], arg: object) -> int | None:
    """``command(arg)``; a :class:`~krex.errors.KrexError` becomes its exit code."""
    try:
        return command(arg)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from krex.errors import KrexError

        if not isinstance(exc, KrexError):
            raise
        _error(exc)
        return _exit_code(exc)


def _exit_code(exc: KrexError) -> int:
    """0 ok, 1 error, 2 usage, 124 timeout; a command not found: as the shell says."""
    from krex.errors import CommandNotFound, CommandTimeout, RegionTimeout, UsageError

    if isinstance(exc, (RegionTimeout, CommandTimeout)):
        return 124
    if isinstance(exc, UsageError):
        return 2
    if isinstance(exc, CommandNotFound):
        return exc.exit_status
    return 1


def _error(exc: KrexError) -> None:
    from krex.cli.output import error

    error(exc)


if __name__ == "__main__":
    sys.exit(main())
