"""``krex eval``: the headline experiment; ``krex eval report RESULTS.json``: table and plots."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from krex.cli.output import JSON_OUTPUT, console, print_json, table
from krex.errors import BadRequest

if TYPE_CHECKING:
    from rich.progress import TaskID


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="throughput and timing fidelity of every mode, side by side",
                       parents=[JSON_OUTPUT],
                       description="Run the eval workload under several modes in one run, or "
                                   "`krex eval report RESULTS.json` to redo table and plots.")
    p.add_argument("--device", default="cpu",
                   help="cpu, fakegpu:N, cuda:N or rocm:N (default cpu)")
    p.add_argument("--agents", type=int, help="concurrent agents (default 8; quick 2)")
    p.add_argument("--commands", type=int,
                   help="commands per agent and mode, split over the rounds (default 8; quick 1)")
    p.add_argument("--rounds", type=int, help="interleaved rounds of every mode (default 2)")
    p.add_argument("--modes", help="comma-separated (default: all): none,command,function,region,"
                                   "region-noworkers,region-nofreeze,region-nogate,"
                                   "region-noisolate")
    p.add_argument("--profile", help="default, quick, or a JSON file of phase sizes")
    p.add_argument("--quick", action="store_true", help="small profile, 2 agents: under 2 min")
    p.add_argument("--seed", type=int, default=0, help="order of the modes in each round")
    p.add_argument("--no-stagger", action="store_true",
                   help="start every agent at once (default: spread over one command)")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="kill a command after this long and count it failed (default 120)")
    p.add_argument("--out", default="results", help="directory for results (default results/)")
    p.add_argument("--wide", action="store_true",
                   help="every column in the console table (default: the main ones; the "
                        "markdown table always has all)")
    p.add_argument("report", nargs="*", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_eval)


def _config(args: argparse.Namespace):  # -> EvalConfig
    from krex.eval import EvalConfig, parse_modes
    from krex.eval.profile import load

    try:
        modes = parse_modes(args.modes)
    except ValueError as exc:
        raise BadRequest(str(exc), hint="see krex eval --help") from None
    kind, _, index = args.device.partition(":")
    if not (args.device == "cpu" or (kind in ("fakegpu", "cuda", "rocm") and index.isdigit())):
        raise BadRequest(f"krex eval runs on cpu, fakegpu:N, cuda:N or rocm:N, not "
                         f"{args.device}", hint="e.g. --device cuda:0")
    quick = args.quick
    return EvalConfig(device=args.device, agents=args.agents or (2 if quick else 8),
                      commands=args.commands or (1 if quick else 8),
                      rounds=args.rounds or (1 if quick else 2), modes=modes,
                      profile=load(args.profile, quick), seed=args.seed,
                      command_timeout_s=args.timeout_s, stagger=not args.no_stagger)


def cmd_eval(args: argparse.Namespace) -> int:
    from krex.eval import evaluate, report

    if args.report:
        if args.report[0] != "report" or len(args.report) != 2:
            raise BadRequest("unexpected arguments " + " ".join(args.report),
                             hint="krex eval report RESULTS.json")
        return _show_report(args.report[1], report(args.report[1], refresh=True), args.json,
                            args.wide)
    cfg = _config(args)
    command = "krex " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["eval"] else None
    try:
        with _sigterm_unwinds(), _Progress() as progress:
            path, doc = evaluate(cfg, args.out, command, progress)
    except _Terminated:
        console.print("krex eval: terminated; its private daemons are stopped")
        return 128 + 15
    return _show_report(path, report(path), args.json, args.wide)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM unwinds the experiment like Ctrl-C, so each block's private daemon (and its
    workers and fakegpu server) is stopped and reaped on the way out; SIGTERM's default
    action ends the process at once and left them running."""
    import signal

    def terminated(signum: int, frame: object) -> None:
        raise _Terminated

    old = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# The console table's default columns (by title prefix); --wide shows every one.
NARROW = ("mode", "cmd/min", "× command", "p95 infl.", "not clean", "slow but clean", "rank flips",
          "failed")


def narrow(cols: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """The main columns only, with shorter titles, so the table fits 80 columns."""
    keep = [i for i, c in enumerate(cols) if c.startswith(NARROW)]
    short = [cols[i].replace("p95 infl. ", "p95% ").replace(" ms %", "ms")
             .replace("× command", "×cmd").replace("rank flips %", "flips%") for i in keep]
    return short, [[r[i] for i in keep] for r in rows]


def _show_report(path: str, made: dict, as_json: bool, wide: bool = False) -> int:
    from krex.eval.results import console_notes, load, table_rows

    doc = load(path)
    if as_json:
        print_json({"results": path, **made, "summary": doc["summary"], "bound": doc["bound"]})
        return 0
    cols, rows = table_rows(doc)
    if not wide:
        cols, rows = narrow(cols, rows)
    table(f"krex eval on {doc['device']} ({doc['agents']} agents)", cols, rows)
    if not wide:
        console.print("(main columns; --wide or the markdown table for all)")
    for note in console_notes(doc):
        console.print(note, highlight=False)
    console.print(f"results: {path}; table: {made['table']}")
    if made["plots_skipped"]:
        console.print(f"plots: {made['plots_skipped']}")
    else:
        console.print("plots: " + ", ".join(os.path.basename(p) for p in made["plots"]))
    return 0


class _Progress:
    """A rich progress bar on stderr: one task per block."""

    def __enter__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.bar = Progress("[progress.description]{task.description}", BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True), transient=False)
        self.bar.start()
        self.tasks: dict[str, TaskID] = {}
        return self.update

    def update(self, label: str, done: int, total: int) -> None:
        if label not in self.tasks:
            self.tasks[label] = self.bar.add_task(label, total=total)
        self.bar.update(self.tasks[label], completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()
