"""bench_command: a whole command timed inside a region, hyperfine-style."""

from __future__ import annotations

import pytest
from helpers import PY

from krex.errors import CommandNotFound, CommandTimeout, UsageError
from krex.measure import CommandFailed, ScriptedRegions, bench_command, loop
from krex.measure.command import relative_speed
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
    with pytest.raises(UsageError):
        bench_command([], 0, 1)
    with pytest.raises(UsageError):
        bench_command([PY, "-c", "pass"], 0, 0)
    with pytest.raises(UsageError):
        bench_command([PY, "-c", "pass"], 0, min_runs=5, max_runs=2)


def test_strings_run_through_the_shell_and_prepare_runs_before_each(tmp_path):
    log = tmp_path / "log"
    out = bench_command(f"echo run >> {log}", 1, 3, prepare=f"echo prep >> {log}",
                        region=ScriptedRegions())
    assert out["command"] == f"echo run >> {log}" and out["argv"][:2] == ["sh", "-c"]
    assert log.read_text().split() == ["prep", "run"] * 4  # warm-up and timed runs


def test_automatic_counts_follow_the_budget_and_bound_the_hold():
    regions = ScriptedRegions()
    out = bench_command([PY, "-c", "import time; time.sleep(0.02)"], 1, min_runs=2,
                        budget_s=0.3, region=regions)
    assert 2 <= out["runs"] <= 15  # ~0.3 s of ~0.03 s runs (interpreter start-up included)
    slack = loop.HOLD_SLACK_S + out["max_s"]
    assert regions.reports[-1].held_s <= 0.3 + slack
    fixed = bench_command([PY, "-c", "pass"], 0, 3, min_runs=10, region=ScriptedRegions())
    assert fixed["runs"] == 3  # --runs wins over the automatic count


def test_a_run_past_its_timeout_is_killed_and_says_so():
    with pytest.raises(CommandTimeout) as info:
        bench_command(["sleep", "5"], 0, 1, timeout_s=0.2, region=ScriptedRegions())
    assert info.value.seconds == 0.2


def test_a_missing_binary_is_command_not_found():
    with pytest.raises(CommandNotFound) as info:
        bench_command(["/nonexistent/bin"], 0, 1, region=ScriptedRegions())
    assert info.value.exit_status == 127


def test_relative_speed_against_the_fastest():
    a = {"command": "a", "mean_s": 1.0, "stddev_s": 0.1}
    b = {"command": "b", "mean_s": 2.0, "stddev_s": 0.2}
    rel = relative_speed([b, a])
    assert rel[1]["fastest"] and rel[1]["relative"] == 1.0
    assert rel[0]["relative"] == pytest.approx(2.0)
    assert rel[0]["relative_stddev"] == pytest.approx(2.0 * (0.01 + 0.01) ** 0.5)
