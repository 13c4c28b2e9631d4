"""Argument parsing and dispatch for ``krex``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from krex.cli import (
    bench_cmds,
    cluster_cmds,
    daemon_cmds,
    demo,
    eval_cmds,
    evaluate_cmds,
    job_cmds,
)
from krex.cli.output import error
from krex.errors import (
    CommandNotFound,
    CommandTimeout,
    KrexError,
    RegionTimeout,
    UsageError,
)

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    daemon_cmds.add_stop, daemon_cmds.add_status, daemon_cmds.add_doctor,
    job_cmds.add_run, job_cmds.add_region, job_cmds.add_exec, bench_cmds.add_bench, demo.add_demo,
    eval_cmds.add_eval, cluster_cmds.add_cluster, evaluate_cmds.add_evaluate,
    evaluate_cmds.add_history,
]


def build_parser(serve_flags: bool = True) -> argparse.ArgumentParser:
    """The whole CLI; ``serve_flags=False`` leaves out ``krex serve``'s flags (they come
    from the daemon's configuration, which a client command does not import)."""
    parser = argparse.ArgumentParser(
        prog="krex", description="Concurrent kernel benchmarking on shared GPUs."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    daemon_cmds.add_serve(sub, with_flags=serve_flags)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(serve_flags=argv[:1] == ["serve"]).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (RegionTimeout, CommandTimeout) as exc:
        error(exc)
        return 124
    except UsageError as exc:
        error(exc)
        return 2
    except CommandNotFound as exc:
        error(exc)
        return exc.exit_status
    except KrexError as exc:
        error(exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
