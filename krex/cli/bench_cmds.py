"""``krex bench -- CMD``: time a whole command inside a region, hyperfine-style."""

from __future__ import annotations

import argparse

from krex.cli.output import JSON_OUTPUT, console, print_json, table


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time a whole command inside a region (hyperfine-style)",
                       parents=[JSON_OUTPUT])
    p.add_argument("--device", help="device the region is taken on (default cpu)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before the region")
    p.add_argument("--runs", type=int, default=10, help="timed runs inside the region")
    p.add_argument("--timeout-s", type=float, help="kill a run that takes longer")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS…")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from krex.cli.job_cmds import _command
    from krex.measure.command import bench_command

    argv = _command(args)
    result = bench_command(argv, warmup_runs=args.warmup, runs=args.runs, device=args.device,
                           timeout_s=args.timeout_s)
    if args.json:
        print_json(result)
        return 0
    ms = 1e3
    table(f"krex bench: {' '.join(argv)}",
          ["runs", "mean ± σ (ms)", "median (ms)", "min … max (ms)", "user (ms)", "system (ms)"],
          [[len(result["times_s"]), f"{result['mean_s'] * ms:.2f} ± {result['stddev_s'] * ms:.2f}",
            f"{result['median_s'] * ms:.2f}",
            f"{result['min_s'] * ms:.2f} … {result['max_s'] * ms:.2f}",
            f"{result['user_s'] * ms:.2f}", f"{result['system_s'] * ms:.2f}"]])
    region = result.get("region") or {}
    console.print(f"region: waited {region.get('waited_s', 0) * ms:.1f} ms, "
                  f"clean {region.get('clean')}")
    for w in result.get("warnings", []):
        console.print(f"warning: {w.get('warning')}: {w.get('detail', '')} "
                      f"(next: {w.get('next_action', '')})")
    return 0
