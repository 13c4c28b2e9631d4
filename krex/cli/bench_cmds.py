"""``krex bench``: time whole commands inside a region, hyperfine-style.

``krex bench [OPTIONS] 'CMD' ['CMD2' ...]`` runs each quoted command through a
shell (``--shell``, default ``sh``; ``none`` splits it instead) and, with
several, compares them (a relative-speed summary, as hyperfine prints);
``krex bench [OPTIONS] -- CMD ARGS…`` runs one argv as given.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from krex.cli.output import JSON_OUTPUT, console, print_json, table
from krex.errors import UsageError


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="device the region is taken on")
    p.add_argument("-w", "--warmup", type=int, default=3,
                   help="untimed runs of each command before its region")
    p.add_argument("-r", "--runs", type=int,
                   help="timed runs per command (default: from --budget-s)")
    p.add_argument("-m", "--min-runs", type=int, default=10,
                   help="automatic counts: at least this many runs")
    p.add_argument("-M", "--max-runs", type=int, help="automatic counts: at most this many runs")
    p.add_argument("--budget-s", type=float, default=3.0,
                   help="automatic counts: seconds of timed runs per command (the region's "
                        "hold, once --min-runs are done)")
    p.add_argument("-p", "--prepare", action="append", metavar="CMD",
                   help="shell command run before every run, untimed (once: for all "
                        "commands; or once per command, in order)")
    p.add_argument("-S", "--shell", default="sh",
                   help="shell that runs quoted commands; 'none' splits them and runs them "
                        "directly")
    p.add_argument("-i", "--ignore-failure", action="store_true",
                   help="keep timing runs that exit non-zero")
    p.add_argument("--timeout-s", type=float,
                   help="kill a run that takes longer and exit 124")
    p.add_argument("--export-json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--export-markdown", metavar="FILE", help="write a markdown table")


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="time whole commands inside a region (hyperfine-style)",
        description="Time commands inside a krex region. Quoted commands run through "
                    "--shell; several are compared. `-- CMD ARGS…` runs one argv as given.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, parents=[JSON_OUTPUT])
    _options(p)
    p.add_argument("cmd", nargs=argparse.REMAINDER,
                   help="'CMD' ['CMD2' …] (through the shell), or -- CMD ARGS… (as given)")
    p.set_defaults(func=cmd_bench)


def commands_of(args: argparse.Namespace) -> list[Any]:
    """The commands to time: one argv after ``--``, else each quoted string.

    Options written after the commands (``krex bench 'sleep 0.1' --runs 3``)
    are parsed here, as hyperfine accepts them anywhere.
    """
    rest = list(args.cmd)
    if rest and rest[0] == "--":
        if len(rest) == 1:
            raise UsageError("krex bench: no command after --",
                             hint="e.g. krex bench -- sleep 0.01")
        return [rest[1:]]
    late = argparse.ArgumentParser(prog="krex bench")
    _options(late)
    late.add_argument("commands", nargs="*")
    late.parse_intermixed_args(rest, namespace=args)
    if not args.commands:
        raise UsageError("krex bench: no command given",
                         hint="e.g. krex bench 'sleep 0.01' or krex bench -- sleep 0.01")
    return list(args.commands)


def _prepares(args: argparse.Namespace, n: int) -> list[str | None]:
    prep = args.prepare or []
    if len(prep) in (0, 1):
        return [prep[0] if prep else None] * n
    if len(prep) != n:
        raise UsageError(f"{len(prep)} --prepare commands for {n} commands",
                         hint="give one --prepare for all commands, or one per command")
    return list(prep)


def cmd_bench(args: argparse.Namespace) -> int:
    from krex.measure.command import bench_command, check_counts, relative_speed

    commands = commands_of(args)
    check_counts(args.runs, args.warmup, args.min_runs, args.max_runs)
    results = []
    for command, prepare in zip(commands, _prepares(args, len(commands)), strict=True):
        results.append(bench_command(
            command, warmup_runs=args.warmup, runs=args.runs, device=args.device,
            shell=args.shell, prepare=prepare, min_runs=args.min_runs, max_runs=args.max_runs,
            budget_s=args.budget_s, timeout_s=args.timeout_s,
            ignore_failure=args.ignore_failure))
    relative = relative_speed(results)
    if args.export_json:
        _write(args.export_json, json.dumps(export_json(results, relative), indent=2) + "\n")
    if args.export_markdown:
        _write(args.export_markdown, export_markdown(results, relative))
    if args.json:
        print_json(export_json(results, relative))
    else:
        _show(results, relative)
    return 0


def export_json(results: list[dict[str, Any]], relative: list[dict[str, Any]]) -> dict:
    """hyperfine's export shape (seconds), with krex's evidence under ``krex`` and the
    fields SKILL.md tells an agent to read (``p50_ms``, ``p95_ms``, ``noise_rel``)."""
    out = []
    for r, rel in zip(results, relative, strict=True):
        out.append({"command": r["command"], "p50_ms": r["p50_ms"], "p95_ms": r["p95_ms"],
                    "noise_rel": r["noise_rel"], "mean": r["mean_s"], "stddev": r["stddev_s"],
                    "median": r["median_s"], "user": r["user_s"], "system": r["system_s"],
                    "min": r["min_s"], "max": r["max_s"], "times": r["times_s"],
                    "exit_codes": r["exit_codes"],
                    "krex": {**r, "relative": rel["relative"],
                             "relative_stddev": rel["relative_stddev"]}})
    return {"format": 1, "results": out}


def export_markdown(results: list[dict[str, Any]], relative: list[dict[str, Any]]) -> str:
    lines = ["| Command | Mean [ms] | Min [ms] | Max [ms] | Relative |",
             "|:---|---:|---:|---:|---:|"]
    for r, rel in zip(results, relative, strict=True):
        rel_text = f"{rel['relative']:.2f}"
        if not rel["fastest"]:
            rel_text += f" ± {rel['relative_stddev']:.2f}"
        lines.append(f"| `{r['command']}` | {r['mean_s'] * 1e3:.1f} ± {r['stddev_s'] * 1e3:.1f} "
                     f"| {r['min_s'] * 1e3:.1f} | {r['max_s'] * 1e3:.1f} | {rel_text} |")
    return "\n".join(lines) + "\n"


def _write(path: str, text: str) -> None:
    """Atomically: a reader never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".krex-bench-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _noise(noise_rel: float | None) -> str:
    return "—" if noise_rel is None else f"{noise_rel:.1%}"


def _show(results: list[dict[str, Any]], relative: list[dict[str, Any]]) -> None:
    ms = 1e3
    table("krex bench (ms)", ["command", "runs", "mean ± σ", "p50", "p95", "noise",
                              "min … max", "user", "system"],
          [[r["command"], r["runs"], f"{r['mean_s'] * ms:.2f} ± {r['stddev_s'] * ms:.2f}",
            f"{r['p50_ms']:.2f}", f"{r['p95_ms']:.2f}", _noise(r["noise_rel"]),
            f"{r['min_s'] * ms:.2f} … {r['max_s'] * ms:.2f}",
            f"{r['user_s'] * ms:.2f}", f"{r['system_s'] * ms:.2f}"] for r in results])
    for r in results:
        region = r.get("region") or {}
        console.print(f"region ({r['command']}): waited {region.get('waited_s', 0) * ms:.1f} ms, "
                      f"held {region.get('held_s', 0) * ms:.1f} ms, clean {region.get('clean')}")
        for w in r.get("warnings", []):
            console.print(f"warning: {w.get('warning')}: {w.get('detail', '')} "
                          f"(next: {w.get('next_action', '')})")
    if len(results) > 1:
        fastest = next(rel for rel in relative if rel["fastest"])
        console.print(f"Summary: `{fastest['command']}` ran")
        for rel in relative:
            if not rel["fastest"]:
                console.print(f"  {rel['relative']:.2f} ± {rel['relative_stddev']:.2f} times "
                              f"faster than `{rel['command']}`")
