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
from krex.errors import KrexError, RegionTimeout

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    daemon_cmds.add_serve, daemon_cmds.add_stop, daemon_cmds.add_status, daemon_cmds.add_doctor,
    job_cmds.add_run, job_cmds.add_region, job_cmds.add_exec, bench_cmds.add_bench, demo.add_demo,
    eval_cmds.add_eval, cluster_cmds.add_cluster, evaluate_cmds.add_evaluate,
    evaluate_cmds.add_history,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="krex", description="Concurrent kernel benchmarking on shared GPUs."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RegionTimeout as exc:
        error(exc)
        return 124
    except KrexError as exc:
        error(exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
