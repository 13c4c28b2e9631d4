"""The headline's guard: a short region-only eval on fakegpu, with the shield as users get it.

The product's figures are the region mode's timing fidelity and the truth of its
reports.  Both regressed once for a week unnoticed (issue 41: a region slowed 2x
on fakegpu still said ``clean``), so a short run of the same experiment holds
them here:

- **truth**: no timed kernel more than 20 % above its alone reference is in a
  region reported clean (``metrics.slow_but_clean``), the 0.1 ms bucket included
  since a rep budget's count follows the region's own sample time (before, 2 of 16
  such kernels, with 1-15 samples, read > 20 % slow in regions no counter could
  fault).  Not under load yet: beside a CPU loop (which the shield puts on the
  device's core) one run had 8 such kernels (a 1 ms kernel read 2.9 ms) in regions
  called clean — the waits of the fake device's serving threads, on the holder's
  core, are in no account; both halves are judged only on a machine quiet enough
  that most regions are clean.
- **fidelity**: the kernels of clean regions are within the bounds below.

The bounds come from runs on the 2-core machine (clean regions' p95 at
≥ 10 / ≥ 1 / ≥ 0.1 ms: 0.14-0.69 / 0.62-3.58 / 0.40-3.94 % in three runs of
2026-12-07, two of them with half the regions not clean), with room above
them.  The code before the fix measured outside them: p95 ≥ 1 ms 86-362 %
with 33 of 37 slow kernels called clean (issue 41's regression).  At 0.1 ms the
bound is loose (see ``P95_BOUND_PCT``).  When
the machine is so busy that few regions are clean (a CPU loop beside the suite
sits on the fake device's core: most regions say ``device_preempted``), nothing
can be judged, and the test says so and skips.  It
skips likewise when other work than the eval's own processes used more than
``MAX_OTHER_CORES`` of the machine's CPUs during the eval (from /proc/stat against
the eval's own CPU time): beside a CPU loop a run once had 9 such kernels with most
regions still clean, the open part of issue 41 that this guard does not yet hold.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time

import pytest
from helpers import run_krex

from krex.devices import fakegpu
from krex.eval import metrics, results

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not fakegpu.available(), reason="fakegpu was not built")]
RUN = ("eval", "--device", "fakegpu:0", "--modes", "region", "--profile", "quick",
       "--agents", "4", "--commands", "4", "--rounds", "1", "--json")
# p95 inflation (%) of kernels in clean regions, per bucket (ms): measured on the quiet
# 2-core machine (docs/notes/headline-eval.md), with room for a noisy CI machine.
# The 0.1 ms bound cannot tell the count's fix from the code before it: a quiet suite read
# 9.45 % with it (10 clean kernels: the p95 is their largest), the code before 9.6-21 %
# alone; tests/test_measure.py's refit test holds that fix, with its control.
P95_BOUND_PCT = {"10": 2.0, "1": 15.0, "0.1": 25.0}
MIN_CLEAN_SHARE = 0.5  # below it the machine is too busy to judge fidelity
MAX_OTHER_CORES = 0.3  # CPUs used by others than the eval beyond it: not a quiet machine


def _busy_cpu_s() -> float:
    """CPU time the whole machine has spent busy (user to steal), seconds."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """This process's CPU time and its reaped descendants' (the eval, its daemon)."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                 resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _processes() -> list[tuple]:
    """krex's processes on the machine as they are (state: R, S, D, T = stopped...), and
    the cgroups each is in: what a hang was waiting on."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "ppid", "status", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "krex" in cmd:
            try:
                with open(f"/proc/{p.info['pid']}/cgroup") as f:
                    groups = [line.rsplit(":", 1)[-1].strip() for line in f if "krex" in line]
            except OSError:
                groups = []
            out.append((p.info["pid"], p.info["ppid"], p.info["status"], cmd[:120], groups))
    return out


def _clean_rows(doc: dict) -> list[dict]:
    return [r for b in doc["blocks"] for r in metrics.inflations(b) if r["clean"] is True]


def test_region_mode_on_fakegpu_is_faithful_and_its_reports_truthful(tmp_path):
    env = dict(os.environ)
    env.pop("KREX_SHIELD", None)  # the suite's daemons leave it off; users get it on as root
    out = tmp_path / "out"
    busy0, own0, t0 = _busy_cpu_s(), _own_cpu_s(), time.monotonic()
    try:
        proc = run_krex(*RUN, "--out", str(out), env=env, timeout=240)
    except subprocess.TimeoutExpired as exc:  # the pool's start race did it (0621f64)
        pytest.fail(f"krex eval did not end in 240 s (usually 15-25 s); its stderr: "
                    f"{(exc.stderr or '')[-2000:]!r}; processes then: {_processes()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    other = ((_busy_cpu_s() - busy0) - (_own_cpu_s() - own0)) / (time.monotonic() - t0)
    doc = results.load(json.loads(proc.stdout)["results"])
    s = doc["summary"]["region"]
    assert s["failed"] == 0 and s["overlaps"] == 0
    print(f"other work beside the eval: {other:.2f} CPUs")
    if other > MAX_OTHER_CORES:
        pytest.skip(f"other work used {other:.2f} CPUs beside the eval (more than "
                    f"{MAX_OTHER_CORES}): not a quiet machine, not judged (issue 41: "
                    "regions beside a CPU loop are not yet truthful)")
    kernels = [r for b in doc["blocks"] for r in metrics.inflations(b)]
    rows = _clean_rows(doc)
    if len(rows) < MIN_CLEAN_SHARE * len(kernels):
        pytest.skip(f"only {len(rows)} of {len(kernels)} timed kernels ran in clean regions "
                    f"(reasons: {s['not_clean_reasons']}): too busy a machine to judge")
    assert metrics.slow_but_clean(kernels)["clean"] == 0, [  # the truth half
        r for r in kernels if r["inflation_pct"] > metrics.SLOW_PCT]
    p95 = metrics.bucket_stats(rows)
    # a quick run draws few kernels per bucket, and a bucket's may all be in unclean
    # regions (CI once had no clean 0.1 ms kernel): what is absent is not judged
    judged = {b: bound for b, bound in P95_BOUND_PCT.items() if b in p95}
    assert judged, (p95, s["not_clean_reasons"])
    for bucket, bound in judged.items():
        assert p95[bucket]["p95"] <= bound, (bucket, p95, s["not_clean_reasons"])
