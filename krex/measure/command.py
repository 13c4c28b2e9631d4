"""Time a whole command inside a region, hyperfine-style (``krex bench -- CMD``).

Warm-up runs happen outside the region (page cache, JIT caches, lazy
compilation), then ``runs`` timed runs inside one region.  Output goes to
/dev/null as in hyperfine; each run's wall time comes from ``perf_counter``
and user/system CPU time from ``RUSAGE_CHILDREN`` deltas.  Returns a
JSON-ready dict in seconds (``mean_s ± stddev_s``, ``min_s``, ``max_s``, ...)
with the region report and warnings.
"""

from __future__ import annotations

import resource
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from krex.errors import KrexError
from krex.measure import checks, loop, stats
from krex.measure.regions import RegionFactory, get_region_factory
from krex.measure.result import RESULT_FORMAT, split_findings, warnings_dicts


class CommandFailed(KrexError):
    code = "command_failed"
    default_hint = "run the command alone to see its error, or pass ignore_failure=True"


def run_once(argv: Sequence[str], timeout_s: float | None) -> tuple[float, float, float, int]:
    """(wall_s, user_s, system_s, exit_code) of one run with output discarded."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=timeout_s,
        check=False,
    )
    wall_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (
        wall_s,
        after.ru_utime - before.ru_utime,
        after.ru_stime - before.ru_stime,
        done.returncode,
    )


def _runs(argv, count, timeout_s, ignore_failure) -> list[tuple[float, float, float, int]]:
    out = []
    for _ in range(count):
        result = run_once(argv, timeout_s)
        if result[3] != 0 and not ignore_failure:
            raise CommandFailed(f"command exited with status {result[3]}: {' '.join(argv)}")
        out.append(result)
    return out


def bench_command(
    argv: Sequence[str],
    warmup_runs: int = 3,
    runs: int = 10,
    device: str | None = None,
    *,
    region: RegionFactory | None = None,
    retries: int = 1,
    label: str | None = None,
    timeout_s: float | None = None,
    max_hold_s: float | None = None,
    ignore_failure: bool = False,
) -> dict[str, Any]:
    """Time ``argv``: warm-up runs outside the region, ``runs`` timed runs inside it."""
    if not argv:
        raise ValueError("no command to time")
    if runs < 1:
        raise ValueError("runs must be at least 1")
    device = device or "cpu"
    warm = _runs(argv, warmup_runs, timeout_s, ignore_failure)
    guess_s = max((w[0] for w in warm), default=timeout_s or 60.0)
    hold_s = max_hold_s or runs * guess_s * 3 + loop.HOLD_MARGIN_S
    run = loop.in_region(
        lambda hold: _runs(argv, runs, timeout_s, ignore_failure),
        get_region_factory(region), device, retries=retries, label=label, max_hold_s=hold_s,
    )  # fmt: skip
    return _summary(argv, device, warmup_runs, run)


def _summary(argv, device, warmup_runs, run: loop.RegionRun) -> dict[str, Any]:
    times = [r[0] for r in run.value]
    findings = [
        *checks.region(run.report),
        *checks.plausibility([t * 1e3 for t in times], run.report.get("held_s")),
    ]
    warnings, details = split_findings(findings)
    return {
        "format": RESULT_FORMAT,
        "command": " ".join(argv),
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
        "exit_codes": [r[3] for r in run.value],
        "region": run.report,
        "attempts": run.attempts,
        "warnings": warnings_dicts(warnings, details),
    }
