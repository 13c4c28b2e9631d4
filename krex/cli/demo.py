"""``krex demo``: the main job on the embedded default.

Runs the example benchmarking commands from ``examples/`` concurrently as
managed jobs under an auto-started daemon, then prints a summary table of
regions waited and held per job, and checks that no two exclusive regions
on a device overlapped -- from the daemon's grant records, and from the
jobs' own observations: each Python example runs under
:mod:`krex.cli.demo_witness`, which records the job's regions by its own
clock and a heartbeat of the job; a region of one job intersecting another's,
or another job's heartbeat inside a region (a sibling that ran while it
should have been frozen), is an overlap.  A job whose first heartbeat came
after a region began (a latecomer) is counted apart.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from krex.cli.output import JSON_OUTPUT, console, ms, print_json, table
from krex.errors import BadRequest

EXAMPLES = ["compute_kernel.py", "memory_kernel.py", "compare_kernels.py", "shell_region.sh"]


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the examples concurrently and summarise their regions",
                       parents=[JSON_OUTPUT])
    p.add_argument("--device", default="cpu")
    p.add_argument("--copies", type=int, default=2, help="concurrent copies of each example")
    p.add_argument("--reps", type=int, default=6, help="regions per example")
    p.add_argument("--examples", help="directory holding the examples (default: the repo's)")
    p.set_defaults(func=cmd_demo)


def _examples_dir(arg: str | None) -> Path:
    path = Path(arg) if arg else Path(__file__).resolve().parents[2] / "examples"
    if not path.is_dir():
        raise BadRequest(f"examples directory {path} not found",
                         hint="run from a krex checkout or pass --examples DIR")
    return path


def _launch(example: Path, name: str, args: argparse.Namespace,
            trace: str) -> subprocess.Popen:
    interp = ([sys.executable, "-m", "krex.cli.demo_witness", trace]
              if example.suffix == ".py" else ["sh"])
    env = {**os.environ, "KREX_PYTHON": sys.executable}
    cmd = [sys.executable, "-m", "krex", "run", "--device", args.device, "--name", name, "--",
           *interp, str(example), str(args.reps)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def cmd_demo(args: argparse.Namespace) -> int:
    folder = _examples_dir(args.examples)
    from krex.client.autostart import daemon_reachable  # here: `krex --help` builds this parser
    from krex.client.connection import Client
    from krex.protocol.address import socket_path

    # The daemon the demo starts is the demo's: stopped at its end, so that it holds
    # nothing (the shield's cores, say) after the main job; one already running stays.
    started = not daemon_reachable(socket_path())
    client = Client()  # auto-starts the embedded daemon when none is running
    try:
        return _demo(args, folder, client)
    finally:
        if started:
            from krex.cli.daemon_cmds import stop_daemon
            from krex.errors import DaemonNotRunning

            with contextlib.suppress(DaemonNotRunning):  # it went already
                stop_daemon(Client(autostart=False, check_installation=False))


def _demo(args: argparse.Namespace, folder: Path, client: Any) -> int:
    tag = f"demo{os.getpid()}"
    procs = {}
    traces = tempfile.mkdtemp(prefix="krex-demo-")
    try:
        for ex in EXAMPLES:
            for copy in range(args.copies):
                name = f"{tag}-{Path(ex).stem}-{copy}"
                procs[name] = _launch(folder / ex, name, args, os.path.join(traces, name))
        outputs = {name: p.communicate()[0] for name, p in procs.items()}
        seen = _load_traces(traces)
    finally:
        shutil.rmtree(traces, ignore_errors=True)
    codes = {name: p.returncode for name, p in procs.items()}
    records = [r for r in client.regions(limit=None) if (r.get("job") or "").startswith(tag)]
    accounts = {j["name"]: j for j in client.jobs() if j["name"].startswith(tag)}
    client.close()
    summary = _summarise(records, codes, tag, accounts)
    summary["observed"] = observed_overlaps(seen)
    if args.json:
        print_json(summary)
    else:
        _show(summary, outputs)
    obs = summary["observed"]
    overlap = summary["overlaps"] or obs["region_overlaps"] or obs["sibling_ran"]
    return 0 if all(c == 0 for c in codes.values()) and not overlap else 1


def _load_traces(folder: str) -> dict[str, dict[str, Any]]:
    out = {}
    for name in os.listdir(folder):
        try:
            with open(os.path.join(folder, name)) as f:
                out[name] = json.load(f)
        except (OSError, ValueError):
            pass
    return out


def observed_overlaps(traces: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Overlap judged from the jobs' own observations (:mod:`krex.cli.demo_witness`):
    ``region_overlaps`` (pairs of regions of two jobs that intersect), ``sibling_ran``
    (regions during which another job, already running when it began, beat) and
    ``sibling_beats``; ``latecomer_beats``: beats of jobs that started during it."""
    spans = [(t0, t1, name) for name, tr in traces.items() for t0, t1 in tr["regions"]]
    spans.sort()
    pairs = sum(1 for i, (a0, a1, an) in enumerate(spans) for b0, _, bn in spans[i + 1:]
                if b0 < a1 and bn != an)
    beats = {name: sorted(tr["beats"]) for name, tr in traces.items()}
    ran = beaten = late = 0
    for t0, t1, holder in spans:
        inside = 0
        for name, ts in beats.items():
            if name == holder or not ts:
                continue
            n = bisect.bisect_left(ts, t1) - bisect.bisect_right(ts, t0)
            if ts[0] < t0:
                inside += n
            else:
                late += n
        ran += inside > 0
        beaten += inside
    return {"jobs": len(traces), "regions": len(spans), "region_overlaps": pairs,
            "sibling_ran": ran, "sibling_beats": beaten, "latecomer_beats": late}


def _summarise(records: list[dict[str, Any]], codes: dict[str, int], tag: str,
               accounts: dict[str, dict[str, Any]] | None = None) -> dict:
    jobs = []
    for name, code in codes.items():
        account = (accounts or {}).get(name, {})
        mine = [r for r in records if r["job"] == name]
        waited = [r["waited_s"] for r in mine]
        held = [r["held_s"] for r in mine]
        jobs.append({"job": name.removeprefix(tag + "-"), "exit_code": code,
                     "regions": len(mine), "clean": sum(bool(r.get("clean")) for r in mine),
                     "not_clean": not_clean_reasons(mine),
                     "waited_p50_s": statistics.median(waited) if waited else None,
                     "waited_max_s": max(waited, default=None),
                     "held_p50_s": statistics.median(held) if held else None,
                     "held_max_s": max(held, default=None),
                     "held_total_s": sum(held),
                     # where the job's time went, from the daemon's account (docs/protocol.md)
                     "waited_total_s": account.get("waited_s"),
                     "enforce_total_s": account.get("enforce_s"),
                     "frozen_s": account.get("frozen_s")})
    from krex.eval.metrics import overlaps

    return {"jobs": jobs, "overlaps": overlaps(records), "regions": len(records)}


def not_clean_reasons(records: list[dict[str, Any]]) -> dict[str, int]:
    """Why regions were not clean: each reason code (the daemon's region records keep
    the codes; docs/protocol.md says what each means), and in how many regions."""
    why: dict[str, int] = {}
    for r in records:
        if r.get("clean"):
            continue
        for code in set(r.get("reasons") or []) or {"no reason recorded"}:
            why[code] = why.get(code, 0) + 1
    return why


def _show_not_clean(jobs: list[dict[str, Any]]) -> None:
    for j in jobs:
        if j.get("not_clean"):
            because = "; ".join(f"{m}" + (f" (×{n})" if n > 1 else "")
                                for m, n in sorted(j["not_clean"].items(), key=lambda x: -x[1]))
            console.print(f"not clean: {j['job']}: {j['regions'] - j['clean']} of "
                          f"{j['regions']} regions: {because} (docs/protocol.md, reason codes)")


def _show(summary: dict[str, Any], outputs: dict[str, str]) -> None:
    for name, out in outputs.items():
        for line in out.strip().splitlines()[-3:]:
            console.print(f"[dim]{name.split('-', 1)[1]}:[/dim] {line}")
    table("regions per job (ms)",
          ["job", "exit", "regions", "clean", "waited total", "waited max",
           "frozen by others", "set-up total", "held p50", "held total"],
          [[j["job"], j["exit_code"], j["regions"], j["clean"], ms(j["waited_total_s"]),
            ms(j["waited_max_s"]), ms(j["frozen_s"]), ms(j["enforce_total_s"]),
            ms(j["held_p50_s"]), ms(j["held_total_s"])] for j in summary["jobs"]])
    _show_not_clean(summary["jobs"])
    console.print(f"{summary['regions']} regions, {summary['overlaps']} overlapping "
                  "exclusive regions on any device (daemon's records)")
    obs = summary.get("observed") or {}
    if obs:
        console.print(f"jobs' own observations ({obs['jobs']} jobs, {obs['regions']} regions): "
                      f"{obs['region_overlaps']} overlapping, {obs['sibling_ran']} with a "
                      f"sibling running ({obs['sibling_beats']} heartbeats), "
                      f"{obs['latecomer_beats']} heartbeats of jobs started meanwhile")
