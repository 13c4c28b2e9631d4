"""``krex run``, ``krex region`` and ``krex exec``.

Each command imports what it runs when it runs: ``krex exec`` is on agents'
paths and must start in a blink (tests/test_startup.py says what it imports).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from krex.cli.output import JSON_OUTPUT
from krex.errors import BadRequest, UsageError

if TYPE_CHECKING:
    from krex.protocol.report import RegionReport


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        example = {"region": "krex region -- ./timed_binary",
                   "bench": "krex bench -- sleep 0.01"}.get(args.command,
                                                           "krex run -- python bench.py")
        raise UsageError(f"krex {args.command}: no command given",
                         hint=f"put the command after --, e.g. {example}")
    return cmd


def add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a command as a managed job")
    p.add_argument("--device", help="device the job benchmarks on (default cpu or $KREX_DEVICE)")
    p.add_argument("--name", help="job name shown in status and reports")
    p.add_argument("--mode", choices=["region", "command", "none"], default="region",
                   help="region: exclusivity inside regions (default); command: the job holds "
                        "its device from start to exit; none: no exclusivity")
    p.add_argument("--cluster", metavar="ADDRESS", help="run on a Ray cluster (docs/cluster.md)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS…")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from krex.client.job import python_for, run_job

    if args.cluster:
        from krex.cli.cluster_cmds import run_on_cluster
        return run_on_cluster(args.cluster, _command(args), device=args.device)
    cmd = _command(args)
    argv, note = python_for(cmd, dict(os.environ))
    if note:
        print(note, file=sys.stderr)
    return run_job(argv, device=args.device, name=args.name or os.path.basename(cmd[0]),
                   mode=args.mode)


def add_region(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "region", help="run a command inside a critical region",
        description="Wait for the device, then run CMD holding it: while CMD runs, the other "
                    "managed jobs on the device are gated, drained and frozen and CMD has "
                    "exclusive use of it (and its own cores). Time only what needs it: a whole "
                    "command includes its start-up. The exit code is CMD's (124: the region was "
                    "not granted within --timeout-s). Afterwards one line on stderr says what "
                    "the region was: its id, time waited and held, and whether it was clean "
                    "(and why not).",
        epilog="example: krex region --label gemm -- python time_gemm.py")
    p.add_argument("--device", help="device (default $KREX_DEVICE or cpu)")
    p.add_argument("--label", help="label recorded in the region report")
    p.add_argument("--max-hold-s", type=float, help="revoke the region after this long")
    p.add_argument("--timeout-s", type=float, help="give up waiting for the device after this")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="do not print the region's one-line summary on stderr")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS…")
    p.set_defaults(func=cmd_region)


def cmd_region(args: argparse.Namespace) -> int:
    import subprocess

    from krex.client.job import exit_code_of
    from krex.client.region import Region
    from krex.errors import command_error

    cmd = _command(args)
    region = Region(args.device or os.environ.get("KREX_DEVICE"), label=args.label or cmd[0],
                    max_hold_s=args.max_hold_s, timeout_s=args.timeout_s)
    with region:
        try:
            code = exit_code_of(subprocess.call(cmd))
        except OSError as exc:
            raise command_error(cmd[0], exc) from None
    if not args.quiet:
        _say_region(region)
    return code


def _say_region(region: Any) -> None:
    """The one line about ``region`` on stderr; a report the daemon never sent (it
    stopped, say) is said too, and does not change the command's exit code."""
    try:
        report = region.report
    except Exception as exc:  # noqa: BLE001 - whatever lost it (Region.report), CMD ran
        print(f"krex: region report lost: {exc}", file=sys.stderr)
        return
    if report is not None:
        print(region_line(report), file=sys.stderr)


def region_line(report: RegionReport) -> str:
    """``krex region``'s one line: which region, waited, held, clean (or why not)."""
    which = "" if report.region is None else f"{report.region} "
    clean = "clean" if report.clean else f"not clean: {report.why_not_clean() or 'unknown'}"
    return (f"krex: region {which}{report.label!r} on {report.device}: waited "
            f"{report.waited_s * 1e3:.1f} ms, held {report.held_s * 1e3:.1f} ms, {clean}")


def add_exec(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("exec", help="run a Python program in a warm worker",
                       parents=[JSON_OUTPUT])
    p.add_argument("--device", help="device whose warm workers run it (default cpu)")
    p.add_argument("--timeout-s", type=float, help="kill the program (and its worker) after this")
    p.add_argument("--cluster", metavar="ADDRESS", help="run on a Ray cluster (docs/cluster.md)")
    p.add_argument("program", help="PROG.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=cmd_exec)


def cmd_exec(args: argparse.Namespace) -> int:
    from krex.cli.lean import exec_program

    if args.cluster:
        if not os.path.isfile(args.program):
            raise BadRequest(f"no such program: {args.program}",
                             hint="give the path of a .py file")
        from krex.cli.cluster_cmds import exec_on_cluster
        return exec_on_cluster(args.cluster, args.program, args.args, device=args.device,
                               timeout_s=args.timeout_s, json_out=args.json)
    return exec_program(args.program, args.args, device=args.device,
                        timeout_s=args.timeout_s, json_out=args.json)
