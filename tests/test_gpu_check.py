"""Smoke test of benchmarks/gpu_check.py on fakegpu: it runs clean and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
CHECKS = ("environment", "interposition", "gate_drain", "checkpoint_lock", "inflation",
          "contexts")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gpu_check_quick_on_fakegpu(tmp_path):
    from krex.devices import fakegpu

    if not fakegpu.available():
        pytest.skip("fakegpu was not built")
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, SCRIPT, "--device", "fakegpu:0", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| check | status |" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == 1 and doc["device"] == "fakegpu:0" and doc["complete"]
    checks = doc["checks"]
    assert set(checks) == set(CHECKS)
    for name, result in checks.items():
        assert result["ok"], (name, result.get("error"))
    stacks = checks["interposition"]["stacks"]
    for stack in ("torch_eager", "cublas", "triton"):
        assert "real CUDA GPU" in stacks[stack]["skipped"]
    ctypes_stack = stacks["ctypes"]
    assert ctypes_stack["caught"] == ctypes_stack["expected"] > 0
    assert ctypes_stack["interposer"]["unmatched"] == 0
    gd = checks["gate_drain"]
    assert gd["regions"] == 20 and gd["gated_jobs_min"] >= 1
    assert gd["latency_ms"]["gate_drain_apply_ms"]["n"] == 20
    inflation = checks["inflation"]  # structure only: fakegpu on a small machine is noisy
    assert set(inflation["inflation_pct"]) == {"none", "freeze", "region"}
    for buckets in inflation["inflation_pct"].values():
        assert set(buckets) == {"driver-0.05ms", "driver-0.5ms", "driver-5ms"}
    assert inflation["clean_fraction"]["region"] > 0
    cold = checks["contexts"]["cold"]
    assert set(cold) == {"driver-1", "driver-4", "driver-8"}
    # fakegpu serialises context creation (300 ms each): 8 processes take >= 8 x 300 ms
    assert cold["driver-8"]["all_ready_ms"] >= 8 * 300 * 0.9
    warm = checks["contexts"]["warm_workers"]
    assert warm["warm"][0]["spawn_to_ready_ms"] < warm["first"]["spawn_to_ready_ms"]
