"""The cpu device with the real CpuTimer: krex.bench against an isolated pyperf run.

The machine drifts by up to ±30 % between minutes, so the pyperf run is
bracketed by two krex measurements and the tolerance is built from what the
runs themselves report: 3 x (krex noise + pyperf noise) plus the drift seen
between the two krex runs, never less than 5 %.  When the machine's CPU pressure
(PSI) shows tasks waiting for a CPU during pyperf's run, an unprotected pyperf is
no reference: a disagreement then skips, with the pressure, instead of failing.
"""

from __future__ import annotations

import json
import os
import time
import types

import pytest
from helpers import PY, reap, spawn

from krex.measure import ScriptedRegions, measure, stats

N = 30_000


KREX_SCRIPT = f"""
import json
import os
from krex.measure import ScriptedRegions, measure
m = measure(lambda: sum(range({N})), device="cpu", cache="hot", region=ScriptedRegions(),
            warmup_ms=20, min_time_s=0.2, max_time_s=0.6, timeout_s=3.0)
assert m.region.clean and m.offcpu_fraction is not None
print(json.dumps({{"median_ms": m.median_ms, "noise_rel": m.noise_rel}}))
"""


def _krex_once():
    """krex.measure in a fresh process, as pyperf measures in fresh processes: the
    state of a long-lived interpreter (allocator, caches) shifts a bigint loop by
    ~10 %, which is not what this test compares."""
    # The environment pyperf gives its workers (--inherit-environ=PATH): the size of
    # the environment shifts the stack, and tight loops by several percent with it.
    proc = spawn([PY, "-c", KREX_SCRIPT], env={"PATH": os.environ.get("PATH", "")})
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        reap(proc)
    assert proc.returncode == 0, err
    return types.SimpleNamespace(**json.loads(out.strip().splitlines()[-1]))


PYPERF_SCRIPT = f"""
import pyperf


def kernel():
    return sum(range({N}))


pyperf.Runner().bench_func("kernel", kernel)
"""


def _cpu_stall_s() -> float | None:
    """Seconds some task of this machine has waited for a CPU (PSI), or None without PSI."""
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline().split()
    except OSError:
        return None
    return int(some[-1].partition("=")[2]) / 1e6


def _pyperf(tmp_path):
    """pyperf's own runner on the same function (calls through a function, like krex)."""
    out = tmp_path / "pyperf.json"
    script = tmp_path / "pyperf_kernel.py"
    script.write_text(PYPERF_SCRIPT)
    proc = spawn([PY, str(script), "-q", "-p", "3", "-n", "5", "-w", "1", "-l", "100",
                  "-o", str(out), "--inherit-environ=PATH"])
    try:
        proc.communicate(timeout=60)
    finally:
        reap(proc)
    assert proc.returncode == 0
    data = json.loads(out.read_text())
    runs = [run["values"] for run in data["benchmarks"][0]["runs"] if run.get("values")]
    return [[v * 1e3 for v in values] for values in runs]  # one list per worker process


@pytest.mark.slow
def test_bench_agrees_with_pyperf_within_the_noise_both_report(tmp_path):
    before = _krex_once()
    stall, wall = _cpu_stall_s(), time.monotonic()
    pyperf_runs = _pyperf(tmp_path)
    wall = time.monotonic() - wall
    stall = None if stall is None else (_cpu_stall_s() - stall) / wall
    after = _krex_once()
    krex_ms = (before.median_ms + after.median_ms) / 2
    pyperf_ms = [v for run in pyperf_runs for v in run]
    pyperf_median = stats.median(pyperf_ms)
    # Noise as both report it: within a process (krex's noise_rel, pyperf's spread of
    # values) and between processes (krex's two runs, pyperf's worker processes).
    drift = abs(before.median_ms - after.median_ms) / krex_ms
    medians = [stats.median(run) for run in pyperf_runs]
    between = (max(medians) - min(medians)) / pyperf_median
    noise = max(before.noise_rel, after.noise_rel) + stats.relative_noise(pyperf_ms)
    tolerance = max(0.05, 3 * noise + drift + between)
    gap = abs(pyperf_median / krex_ms - 1)
    if gap > tolerance and stall is not None and stall > 0.05:
        # pyperf is the unprotected reference: each of its values is the mean of 100 calls
        # (~30 ms), so a task sharing its core slows every value alike and its spread
        # stays small (seen: pyperf 0.57 ms against krex 0.31 ms beside a CPU loop).
        pytest.skip(f"the reference is not trustworthy: tasks waited for a CPU {stall:.0%}"
                    f" of pyperf's run (PSI); pyperf {pyperf_median:.4f} ms, krex"
                    f" {krex_ms:.4f} ms")
    assert gap <= tolerance, (
        f"krex {before.median_ms:.4f}/{after.median_ms:.4f} ms vs pyperf {pyperf_median:.4f} ms:"
        f" gap {gap:.1%} > tolerance {tolerance:.1%}"
    )


def test_cold_cache_on_cpu_flushes_a_buffer_twice_the_llc():
    m = measure(
        lambda: sum(range(1000)),
        device="cpu",
        cache="cold",
        region=ScriptedRegions(),
        rep_ms=5,
        warmup_ms=1,
    )
    assert m.cache == "cold" and m.iterations >= 1
    # each sample pays a flush outside the sample: the loop's wall time is much longer
    assert m.elapsed_s * 1e3 > 2 * sum(m.samples_ms)


def test_real_daemon_region_report_is_attached(daemon):
    m = measure(lambda: sum(range(1000)), device="cpu", rep_ms=5, warmup_ms=1, cache="hot")
    assert m.region.region is not None and m.region.clean is not None
    assert sum(m.samples_ms) / 1e3 <= m.region.held_s * 1.005 + 0.001
    assert m.region.device == "cpu" and m.region.mode in ("region", "command", "none")
