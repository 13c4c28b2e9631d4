"""bench_command: a whole command timed inside a region, hyperfine-style."""

from __future__ import annotations

import pytest
from helpers import PY

from krex.measure import CommandFailed, ScriptedRegions, bench_command
from krex.protocol.report import Reason, ReasonCode


def test_times_a_command_inside_one_region():
    regions = ScriptedRegions()
    out = bench_command(
        [PY, "-c", "import time; time.sleep(0.03)"],
        warmup_runs=1,
        runs=3,
        device="cpu",
        region=regions,
    )
    assert regions.taken == 1 and out["runs"] == 3 and len(out["times_s"]) == 3
    assert 0.03 <= out["min_s"] <= out["median_s"] <= out["max_s"] < 5
    assert out["mean_s"] >= out["min_s"] and out["stddev_s"] >= 0
    assert out["exit_codes"] == [0, 0, 0] and out["warnings"] == []
    assert sum(out["times_s"]) <= out["region"]["held_s"]  # timed runs fit in the hold
    assert out["user_s"] >= 0 and out["format"] == 2


def test_warmup_runs_happen_outside_the_region(tmp_path):
    marker = tmp_path / "runs"
    script = f"open({str(marker)!r}, 'a').write('x')"
    counts = {}

    class Spy(ScriptedRegions):
        def __call__(self, device=None, **kwargs):
            counts["at_enter"] = len(marker.read_text()) if marker.exists() else 0
            return super().__call__(device, **kwargs)

    bench_command([PY, "-c", script], warmup_runs=2, runs=3, region=Spy())
    assert counts["at_enter"] == 2 and len(marker.read_text()) == 5


def test_failing_command_raises_unless_ignored():
    with pytest.raises(CommandFailed) as info:
        bench_command([PY, "-c", "raise SystemExit(3)"], 0, 1, region=ScriptedRegions())
    assert "status 3" in str(info.value) and info.value.hint
    out = bench_command(
        [PY, "-c", "raise SystemExit(3)"], 0, 2, region=ScriptedRegions(), ignore_failure=True
    )
    assert out["exit_codes"] == [3, 3]


def test_not_clean_region_warns():
    failed = Reason(ReasonCode.STEP_FAILED, "isolate: OSError")
    regions = ScriptedRegions([{"reasons": [failed]}])
    out = bench_command([PY, "-c", "pass"], 0, 1, region=regions, retries=1)
    assert regions.taken == 2
    assert [w["warning"] for w in out["warnings"]] == ["REGION_NOT_CLEAN"]


def test_bad_arguments():
    with pytest.raises(ValueError):
        bench_command([], 0, 1)
    with pytest.raises(ValueError):
        bench_command([PY, "-c", "pass"], 0, 0)
