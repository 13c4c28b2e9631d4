"""The headline's guard: a short region-only eval on fakegpu, with the shield as users get it.

The product's figures are the region mode's timing fidelity and the truth of its
reports.  Both regressed once for a week unnoticed (issue 41: a region slowed 2x
on fakegpu still said ``clean``), so a short run of the same experiment holds
them here:

- **truth**: no timed kernel more than 20 % above its alone reference is in a
  region reported clean (``metrics.slow_but_clean``), whatever the machine's load;
- **fidelity**: the kernels of clean regions are within the bounds below.

The bounds come from the variance measured on the 2-core machine
(docs/benchmarks.md, "The headline's guard"), with room above it; the code
before the fix measured far outside them (p95 ≥ 1 ms 86-362 %, 33 of 37 slow
kernels called clean).  When the machine is so busy that few regions are clean
(a CPU loop beside the suite sits on the fake device's core: every region says
``device_preempted``), fidelity cannot be judged and the test says so and skips
that half; the truth half always runs.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import run_krex

from krex.devices import fakegpu
from krex.eval import metrics, results

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not fakegpu.available(), reason="fakegpu was not built")]
RUN = ("eval", "--device", "fakegpu:0", "--modes", "region", "--profile", "quick",
       "--agents", "4", "--commands", "4", "--rounds", "1", "--json")
# p95 inflation (%) of kernels in clean regions, per bucket (ms): measured on the quiet
# 2-core machine (docs/benchmarks.md), with room for a noisy CI machine.
P95_BOUND_PCT = {"10": 2.0, "1": 10.0, "0.1": 25.0}
MIN_CLEAN_SHARE = 0.5  # below it the machine is too busy to judge fidelity


def _clean_rows(doc: dict) -> list[dict]:
    return [r for b in doc["blocks"] for r in metrics.inflations(b) if r["clean"] is True]


def test_region_mode_on_fakegpu_is_faithful_and_its_reports_truthful(tmp_path):
    env = dict(os.environ)
    env.pop("KREX_SHIELD", None)  # the suite's daemons leave it off; users get it on as root
    out = tmp_path / "out"
    proc = run_krex(*RUN, "--out", str(out), env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = results.load(json.loads(proc.stdout)["results"])
    s = doc["summary"]["region"]
    assert s["failed"] == 0 and s["overlaps"] == 0
    assert s["slow_kernels"]["clean"] == 0, s["slow_kernels"]  # the truth half
    rows = _clean_rows(doc)
    kernels = [r for b in doc["blocks"] for r in metrics.inflations(b)]
    if len(rows) < MIN_CLEAN_SHARE * len(kernels):
        pytest.skip(f"only {len(rows)} of {len(kernels)} timed kernels ran in clean regions "
                    f"(reasons: {s['not_clean_reasons']}): too busy a machine to judge fidelity")
    p95 = metrics.bucket_stats(rows)
    for bucket, bound in P95_BOUND_PCT.items():
        assert p95[bucket]["p95"] <= bound, (bucket, p95, s["not_clean_reasons"])
