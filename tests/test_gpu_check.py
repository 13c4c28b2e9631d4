"""benchmarks/gpu_check.py: its device-clock judgement, and a quick run on fakegpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
CHECKS = ("prerequisites", "environment", "interposition", "held", "overlap", "gate_drain",
          "checkpoint_lock", "inflation", "contexts", "device_truth")


def test_overlap_is_judged_on_device_time_intervals():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from gpu_check_device import judge

    regions = [[[100, 200], [200, 300]], [[1000, 1100]]]
    assert judge(regions, [[0, 99], [301, 999], [1101, 2000]])["overlapping_regions"] == 0
    hit = judge(regions, [[250, 260], [1050, 1200]])  # inside one, straddling the other
    assert hit["overlapping_regions"] == 2 and hit["overlap_ns"] == 10 + 50
    assert judge([[[5, 0]]], [[0, 10]])["overlapping_regions"] == 0  # unfinished stamps


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_check_quick_on_fakegpu(tmp_path):
    from krex.devices import fakegpu

    if not fakegpu.available():
        pytest.skip("fakegpu was not built")
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, SCRIPT, "--device", "fakegpu:0", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| check | status |" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == 2 and doc["device"] == "fakegpu:0" and doc["complete"]
    checks = doc["checks"]
    assert list(checks) == list(CHECKS)
    for name, result in checks.items():
        assert result["ok"], (name, result)
    assert doc["elapsed_s"] < 240
    stacks = checks["interposition"]["stacks"]
    ctypes_stack = stacks["ctypes"]
    assert ctypes_stack["caught"] == ctypes_stack["expected"] > 0
    held = checks["held"]["stacks"]
    assert held["ctypes"]["ok"] and held["ctypes"]["parked"] > 0  # held by the closed gate
    assert "real CUDA GPU" in held["torch_graph"]["skipped"]
    cases = checks["overlap"]["cases"]
    assert cases["region"]["overlapping_regions"] == 0
    assert cases["positive_control"]["overlapping_regions"] > 0  # the method sees overlaps
    assert cases["negative_control"]["overlapping_regions"] == 0
    gd = checks["gate_drain"]
    assert gd["regions"] == 20 and gd["gated_jobs_min"] >= 1
    inflation = checks["inflation"]  # structure only: fakegpu on a small machine is noisy
    assert set(inflation["inflation_pct"]) == {"none", "freeze", "region"}
    for buckets in inflation["inflation_pct"].values():
        assert set(buckets) == {"0.1", "1", "10"}  # krex eval's buckets
    assert set(inflation["krex_alone_vs_bare_pct"]) == {"0.1", "1", "10"}
    truth = checks["device_truth"]  # through the fake NVML: the daemon's path to it is real
    assert truth["foreign_named"] == [True, True, True], truth
    assert not any("foreign_device_process" in c for c in truth["control_reasons"]), truth
    assert truth["throttle"]["throttled"] and truth["throttle"]["clock_ratio_at_release"] == 1.0
    assert truth["throttle"]["min_clock_ratio_between"] == 0.5
    cold = checks["contexts"]["cold"]
    assert cold["driver-8"]["all_ready_ms"] >= 8 * 300 * 0.9


def test_a_missing_prerequisite_stops_the_run_with_its_name(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PATH="/nonexistent")  # no nvidia driver here: cuda:0 is unusable
    done = subprocess.run([sys.executable, SCRIPT, "--device", "cuda:0", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    pre = doc["checks"]["prerequisites"]
    assert not pre["ok"] and any("libcuda" in m or "nvidia-ml-py" in m for m in pre["missing"])
    assert "missing prerequisites" in done.stderr
