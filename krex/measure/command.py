"""Time a whole command inside a region, hyperfine-style (``krex bench``).

A command is an argv list (run as given) or a string (run through a shell,
``sh -c`` by default, as hyperfine does; ``shell="none"`` splits it with
``shlex`` instead).  Warm-up runs happen outside the region (page cache, JIT
caches, lazy compilation), then the timed runs inside one region.  Output
goes to /dev/null as in hyperfine; each run's wall time comes from
``perf_counter`` and user/system CPU time from ``RUSAGE_CHILDREN`` deltas.
``prepare`` (a shell command) runs before every run, untimed.  ``run_as``
(a service's bench for a tenant on a root node): every run as that user.

The number of timed runs is ``runs`` when given; otherwise it follows a time
budget: ``budget_s`` worth of runs at the warm-up's pace, at least
``min_runs`` and at most ``max_runs``; runs stop early when the next one
would take the hold past the budget (once ``min_runs`` are done).  Returns a
JSON-ready dict in seconds (``mean_s ± stddev_s``, ``min_s``, ``max_s``, ...)
with the region report and warnings.
"""

from __future__ import annotations

import os
import resource
import shlex
import signal
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from krex.errors import CommandFailed, CommandTimeout, UsageError, command_error
from krex.measure import checks, loop, stats
from krex.measure.regions import RegionFactory, get_region_factory
from krex.measure.result import RESULT_FORMAT, split_findings, warnings_dicts
from krex.protocol.runas import RunAs

Command = Sequence[str] | str


@dataclass
class Spec:
    """How one command is run: its argv, the untimed preparation, the limits."""

    text: str  # the command as the user wrote it
    argv: list[str]
    prepare: list[str] | None
    timeout_s: float | None
    ignore_failure: bool
    run_as: RunAs | None = None  # who the runs are (None: this process's user)


def as_argv(command: Command, shell: str | None = "sh") -> list[str]:
    """A string runs through ``shell -c`` (or is split when ``shell`` is "none")."""
    if not isinstance(command, str):
        return list(command)
    if shell in (None, "none"):
        return shlex.split(command)
    return [shell, "-c", command]


def run_once(argv: Sequence[str], timeout_s: float | None,
             run_as: RunAs | None = None) -> tuple[float, float, float, int]:
    """(wall_s, user_s, system_s, exit_code) of one run with output discarded.

    The run gets a session of its own, so a timeout kills what it started too.
    """
    env = {**os.environ, **run_as.env()} if run_as else None
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True, env=env,
                                preexec_fn=run_as.preexec() if run_as else None)
    except OSError as exc:
        raise command_error(argv[0], exc) from None
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        raise CommandTimeout(f"{shlex.join(argv)} took longer than {timeout_s:g} s",
                             seconds=timeout_s) from None
    wall_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall_s, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, code


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _one(spec: Spec) -> tuple[float, float, float, int]:
    if spec.prepare:
        prep = run_once(spec.prepare, spec.timeout_s, spec.run_as)
        if prep[3] != 0:
            raise CommandFailed(f"prepare command exited with status {prep[3]}: "
                                f"{shlex.join(spec.prepare)}")
    result = run_once(spec.argv, spec.timeout_s, spec.run_as)
    if result[3] != 0 and not spec.ignore_failure:
        raise CommandFailed(f"command exited with status {result[3]}"
                            f"{' (command not found?)' if result[3] == 127 else ''}: {spec.text}")
    return result


def _runs(spec: Spec, count: int) -> list[tuple[float, float, float, int]]:
    return [_one(spec) for _ in range(count)]


def _budgeted_runs(spec: Spec, plan: tuple[int, int, float], hold: loop.Hold
                   ) -> list[tuple[float, float, float, int]]:
    """Up to ``count`` runs; after ``min_runs``, none that would pass the budget."""
    count, min_runs, budget_s = plan
    out: list[tuple[float, float, float, int]] = []
    while len(out) < count:
        if len(out) >= min_runs:
            pace_s = statistics.median(r[0] for r in out)
            if time.perf_counter() - hold.start_s + pace_s > hold.limit(budget_s):
                break
        out.append(_one(spec))
    return out


def plan_runs(warm_s: Sequence[float], runs: int | None, min_runs: int, max_runs: int | None,
              budget_s: float) -> int:
    """``runs``, else ``budget_s`` of runs at the warm-up's median pace, clamped."""
    if runs is not None:
        return runs
    pace_s = max(statistics.median(warm_s), 1e-6)
    count = max(min_runs, int(budget_s / pace_s))
    return min(count, max_runs) if max_runs is not None else count


def check_counts(runs: int | None, warmup_runs: int, min_runs: int,
                 max_runs: int | None) -> None:
    if runs is not None and runs < 1:
        raise UsageError(f"runs must be at least 1, not {runs}")
    if warmup_runs < 0:
        raise UsageError(f"warm-up runs cannot be negative ({warmup_runs})")
    if min_runs < 1 or (max_runs is not None and max_runs < min_runs):
        raise UsageError(f"need 1 <= min_runs <= max_runs (got {min_runs}, {max_runs})")


def bench_command(
    command: Command,
    warmup_runs: int = 3,
    runs: int | None = None,
    device: str | None = None,
    *,
    shell: str | None = "sh",
    prepare: str | None = None,
    min_runs: int = 10,
    max_runs: int | None = None,
    budget_s: float = 3.0,
    region: RegionFactory | None = None,
    retries: int = 1,
    label: str | None = None,
    timeout_s: float | None = None,
    max_hold_s: float | None = None,
    ignore_failure: bool = False,
    run_as: RunAs | None = None,
) -> dict[str, Any]:
    """Time ``command``: warm-up runs outside the region, the timed runs inside it."""
    argv = as_argv(command, shell)
    if not argv:
        raise UsageError("no command to time")
    check_counts(runs, warmup_runs, min_runs, max_runs)
    device = device or "cpu"
    text = command if isinstance(command, str) else shlex.join(argv)
    spec = Spec(text, argv, as_argv(prepare, shell) if prepare else None, timeout_s,
                ignore_failure, run_as)
    warm = _runs(spec, max(warmup_runs, 0 if runs is not None else 1))
    count = plan_runs([w[0] for w in warm] or [timeout_s or 1.0], runs, min_runs, max_runs,
                      budget_s)
    guess_s = max((w[0] for w in warm), default=timeout_s or 60.0)
    hold_s = max_hold_s or count * guess_s * 3 + loop.HOLD_MARGIN_S
    plan = (count, count if runs is not None else min_runs, budget_s)
    run = loop.in_region(lambda hold: _budgeted_runs(spec, plan, hold),
                         get_region_factory(region), device, retries=retries,
                         label=label or spec.text[:60], max_hold_s=hold_s)
    return _summary(spec, device, warmup_runs, run)


def _summary(spec: Spec, device: str, warmup_runs: int, run: loop.RegionRun) -> dict[str, Any]:
    times = [r[0] for r in run.value]
    findings = [
        *checks.region(run.report),
        *checks.plausibility([t * 1e3 for t in times], run.report.held_s),
    ]
    warnings, details = split_findings(findings)
    return {
        "format": RESULT_FORMAT,
        "command": spec.text,
        "argv": spec.argv,
        "device": device,
        "warmup_runs": warmup_runs,
        "runs": len(times),
        "mean_s": stats.mean(times),
        "stddev_s": stats.stdev(times),
        "median_s": stats.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "user_s": stats.mean([r[1] for r in run.value]),
        "system_s": stats.mean([r[2] for r in run.value]),
        "times_s": times,
        **readings(times),
        "exit_codes": [r[3] for r in run.value],
        "region": run.report.to_dict(),
        "attempts": run.attempts,
        "warnings": warnings_dicts(warnings, details),
    }


def readings(times_s: Sequence[float]) -> dict[str, float | None]:
    """The fields an agent reads (SKILL.md): ``p50_ms``, ``p95_ms`` and ``noise_rel``
    (robust relative noise; None with fewer than two runs)."""
    times_ms = [t * 1e3 for t in times_s]
    return {"p50_ms": stats.median(times_ms) if times_ms else None,
            "p95_ms": stats.quantile(times_ms, 0.95) if times_ms else None,
            "noise_rel": stats.relative_noise(times_ms) if len(times_ms) > 1 else None}


def relative_speed(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each result against the fastest (by mean), hyperfine's way: ratio of means
    with the relative standard deviations added in quadrature."""
    fastest = min(results, key=lambda r: r["mean_s"])
    out = []
    for r in results:
        ratio = r["mean_s"] / fastest["mean_s"]
        rel = ((r["stddev_s"] / r["mean_s"]) ** 2
               + (fastest["stddev_s"] / fastest["mean_s"]) ** 2) ** 0.5
        out.append({"command": r["command"], "relative": ratio,
                    "relative_stddev": ratio * rel if r is not fastest else 0.0,
                    "fastest": r is fastest})
    return out
