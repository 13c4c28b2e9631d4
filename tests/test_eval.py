"""krex eval: schedule, metrics, bound and results as pure logic; a --quick run as a smoke test.

The smoke test checks structure and sanity (every mode present, inflation
finite, command-mode holds never overlap, nothing failed), never targets:
speed and fidelity targets live in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from helpers import run_krex

from krex.eval import bound, metrics, results
from krex.eval.modes import MODES, parse_modes
from krex.eval.profile import DEFAULT, QUICK, Profile
from krex.eval.runner import EvalConfig, schedule


def test_schedule_interleaves_every_mode_once_per_round_and_splits_commands():
    cfg = EvalConfig(commands=5, rounds=2, modes=parse_modes(None), seed=3)
    plan = schedule(cfg)
    assert len(plan) == 2 * len(MODES)
    for rnd in (0, 1):
        names = [m.name for r, m, _ in plan if r == rnd]
        assert sorted(names) == sorted(MODES)
    per_mode = {}
    for _, m, n in plan:
        per_mode[m.name] = per_mode.get(m.name, 0) + n
    assert set(per_mode.values()) == {5}
    assert [m.name for _, m, _ in plan[: len(MODES)]] != [m.name for _, m, _ in plan[len(MODES):]]


def test_unknown_mode_is_rejected_with_the_known_ones():
    with pytest.raises(ValueError, match="region-nogate"):
        parse_modes("none,bogus")


def test_agents_start_spread_over_one_command_unless_told_not_to():
    cfg = EvalConfig(device="fakegpu:0", agents=4)
    p = cfg.profile
    period = (p.import_ms + p.compile_ms + p.check_ms + p.timing_ms("fakegpu:0")) / 1e3
    offsets = [cfg.start_offset_s(a) for a in range(4)]
    assert offsets == pytest.approx([0, period / 4, period / 2, 3 * period / 4])
    assert EvalConfig(agents=4, stagger=False).start_offset_s(3) == 0.0
    assert EvalConfig(agents=1).start_offset_s(0) == 0.0


def test_profile_round_trips_and_quick_is_smaller():
    assert Profile.from_dict(json.loads(json.dumps(DEFAULT.to_dict()))) == DEFAULT
    assert QUICK.compile_ms < DEFAULT.compile_ms and QUICK.rep_ms < DEFAULT.rep_ms
    # timing is about a fifth of a command or less in the default profile
    cmd_ms = DEFAULT.import_ms + DEFAULT.compile_ms + DEFAULT.check_ms + DEFAULT.timing_ms("cpu")
    assert DEFAULT.timing_ms("fakegpu:0") / cmd_ms < 0.25


def _block(mode="region", medians=(1.1, 1.0), ref=(1.0, 1.0), regions=()):
    kernels = [{"kernel": "k-1ms", "bucket_ms": 1.0, "median_ms": m, "region": {"clean": True}}
               for m in medians]
    return {"mode": mode, "round": 0, "start_mono_s": 0.0, "wall_s": 60.0,
            "commands": [{"agent": 0, "index": 0, "ok": True, "wall_s": 1.0,
                          "kernels": kernels, "phases": {}}],
            "refs": {"before": [{"kernel": "k-1ms", "bucket_ms": 1.0, "median_ms": ref[0]}],
                     "after": [{"kernel": "k-1ms", "bucket_ms": 1.0, "median_ms": ref[1]}]},
            "regions": list(regions)}


def test_inflation_is_against_the_faster_of_the_surrounding_references():
    rows = metrics.inflations(_block(medians=(2.0,), ref=(4.0, 1.0)))
    assert rows[0]["ref_ms"] == pytest.approx(1.0)
    assert rows[0]["inflation_pct"] == pytest.approx(100.0)
    one_side = _block(medians=(2.0,))
    one_side["refs"]["after"] = []  # a reference that failed
    assert metrics.inflations(one_side)[0]["ref_ms"] == pytest.approx(1.0)
    s = metrics.summarise({"blocks": [_block(), _block("command")]}, ["region", "command"])
    assert s["region"]["inflation_pct"]["1"]["p50"] == pytest.approx(5.0)
    assert s["region"]["throughput_cpm"] == pytest.approx(1.0)
    assert s["region"]["speedup_vs_command"] == pytest.approx(1.0)
    assert s["region"]["inflation_by_kind_pct"]["k"]["1"]["p50"] == pytest.approx(5.0)
    drifted = metrics.summarise({"blocks": [_block(ref=(1.0, 1.2))]}, ["region"])["region"]
    assert drifted["reference_drift_pct"]["1"]["p95"] == pytest.approx(20.0)


def _pair_block(measured, refs=(1.0, 1.03)):
    """Two kernels ``a`` and ``b`` (references ``refs``), one command per measured pair."""
    ref = [{"kernel": n, "bucket_ms": 1.0, "median_ms": r} for n, r in zip("ab", refs, strict=True)]
    commands = [{"agent": 0, "index": i, "ok": True, "wall_s": 1.0, "phases": {},
                 "kernels": [{"kernel": n, "bucket_ms": 1.0, "median_ms": m,
                              "region": {"clean": True}} for n, m in zip("ab", ms, strict=True)]}
                for i, ms in enumerate(measured)]
    return {"mode": "region", "round": 0, "start_mono_s": 0.0, "wall_s": 60.0,
            "commands": commands, "refs": {"before": ref, "after": ref}, "regions": []}


def test_a_slow_kernel_in_a_region_called_clean_is_counted_as_an_untruthful_report():
    """``slow_kernels``: of the timed kernels > 20 % above alone, those whose region said
    clean.  Control: the same slow kernel in a region reported not clean counts as slow
    only; a kernel within 20 % counts as neither."""
    block = _block(medians=(1.3, 1.19))
    assert metrics.summarise_mode([block])["slow_kernels"] == {"slow": 1, "clean": 1}
    block["commands"][0]["kernels"][0]["region"] = {"clean": False, "reasons": []}
    assert metrics.summarise_mode([block])["slow_kernels"] == {"slow": 1, "clean": 0}


def test_rank_flips_count_commands_that_order_close_candidates_wrongly():
    kept, flipped = (1.00, 1.03), (1.04, 1.02)
    rows = metrics.rank_flips(_pair_block([kept, flipped, kept, kept]))
    assert [r["flipped"] for r in rows] == [False, True, False, False]
    assert rows[0]["pair"] == "a vs b" and rows[0]["ref_gap_pct"] == pytest.approx(-2.91, 0.01)
    s = metrics.summarise_mode([_pair_block([kept, flipped, kept, kept])])["rank_flips"]
    assert s == {"pairs": 1, "comparisons": 4, "flips": 1, "rate_pct": 25.0}
    # Only pairs 1-5 % apart are candidates: far apart or indistinguishable ones are not.
    assert metrics.rank_flips(_pair_block([flipped], refs=(1.0, 1.10))) == []
    assert metrics.rank_flips(_pair_block([flipped], refs=(1.0, 1.005))) == []
    assert metrics.summarise_mode([_block()])["rank_flips"]["rate_pct"] is None


def test_twin_kernels_are_a_few_per_cent_longer():
    from krex.eval.kernels import KernelSpec, device_specs, twin
    from krex.eval.profile import QUICK

    specs = device_specs("fakegpu:0", (0.1, 1.0, 10.0), (1.0,), 1.03)
    assert [(k.name, k.size) for k in specs][-1] == ("spin-1ms+3%", 1030)
    compute = twin(KernelSpec("compute-1ms", "compute", 1.0, 100), 1.03)
    assert compute.size == 101 and 1.02 < (101 / 100) ** 3 < 1.04
    assert QUICK.timing_ms("cpu") == 8 * (QUICK.warmup_ms + QUICK.rep_ms)


def _region(start_s, held_s, waited_s=0.0, nested=False):
    return {"device": "cpu", "exclusive": True, "nested": nested, "waited_s": waited_s,
            "granted_mono_s": start_s, "held_s": held_s}


def test_overlaps_and_handoffs_from_region_records():
    serial = [_region(0, 1.0), _region(1.0005, 1.0, waited_s=0.5), _region(5, 1)]
    assert metrics.overlaps(serial) == 0
    assert metrics.handoffs_us(serial) == [pytest.approx(500, rel=1e-3)]
    assert metrics.overlaps([*serial, _region(0.2, 0.1)]) == 1
    assert metrics.overlaps([*serial, _region(0.5, 1.0, nested=True)]) == 0


def _alone(s=1.0, c=2.0, k=0.5, t=0.5, r=0.3, w=0.01):
    kernels = [{"region": {"held_s": r}}]
    fresh = {"wall_s": s + c + k + t, "kernels": kernels,
             "phases": {"compile_s": c, "check_s": k, "timing_s": t}}
    warm = {"wall_s": w + c + k + t, "kernels": kernels,
            "phases": {"compile_s": c, "check_s": k, "timing_s": t}}
    return {"fresh": [fresh], "warm": [warm]}


def test_bound_command_is_one_command_at_a_time_and_region_is_above_it():
    b = bound.bounds(_alone(), "cpu", 0, list(MODES), cores=2)
    cpm = b["per_mode_cpm"]
    assert cpm["command"] == pytest.approx(60 / 4.0)
    assert cpm["region"] > cpm["region-noworkers"] > cpm["command"]
    assert b["node16_per_mode_cpm"]["region"] > cpm["region"]
    fake = bound.bounds(_alone(), "fakegpu:0", 400, list(MODES), cores=2)["per_mode_cpm"]
    assert fake["function"] <= 60 / (2 * 1.0 + 0.5 + 0.5)


def test_results_file_is_versioned_atomic_and_tabulates(tmp_path):
    names = ["command", "region"]
    raw = {"blocks": [_block(), _block("command")], "alone": _alone(), "spec": {}}
    doc = results.document(raw, metrics.summarise(raw, names),
                           bound.bounds(raw["alone"], "cpu", 0, names, 2),
                           {"device": "cpu", "agents": 1, "commands": 1, "rounds": 1,
                            "modes": names, "profile": QUICK.to_dict(), "command": "krex eval"})
    path = results.write(doc, str(tmp_path / "eval-cpu.json"))
    assert results.load(path)["format"] == results.FORMAT
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []
    md = results.markdown(results.load(path))
    assert "| region |" in md and "krex eval" in md
    assert "ref drift ≥1 ms" in md and "k ≥1 ms" in md
    (tmp_path / "bad.json").write_text('{"format": 99}')
    with pytest.raises(ValueError):
        results.load(str(tmp_path / "bad.json"))


def test_the_calibrating_bar_completes(monkeypatch, tmp_path):
    from krex.eval import runner

    monkeypatch.setattr(runner, "calibrate", lambda cfg, workdir: {})
    monkeypatch.setattr(runner, "alone", lambda cfg, workdir: {})
    monkeypatch.setattr(runner, "schedule", lambda cfg: [])
    seen = []
    runner.run_eval(runner.EvalConfig(), lambda *call: seen.append(call), str(tmp_path))
    assert seen == [("calibrating", 0, 1), ("calibrating", 1, 1)]


def test_console_table_fits_80_columns_and_names_every_mode_in_full(tmp_path):
    names = list(MODES)
    raw = {"blocks": [_block(m) for m in names], "alone": _alone(), "spec": {}}
    doc = results.document(raw, metrics.summarise(raw, names),
                           bound.bounds(raw["alone"], "cpu", 0, names, 2),
                           {"device": "cpu", "agents": 1, "commands": 1, "rounds": 1,
                            "modes": names, "profile": QUICK.to_dict(), "command": "krex eval"})
    path = results.write(doc, str(tmp_path / "eval-cpu.json"))
    env = {**os.environ, "COLUMNS": "80"}
    out = run_krex("eval", "report", path, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    for mode in names:  # a row starts with the whole name
        assert any(line.split()[:1] == [mode] for line in lines), mode
    assert "handoff" not in out.stdout  # the narrow default leaves it out
    wide = run_krex("eval", "report", path, "--wide", env={**env, "COLUMNS": "250"},
                    timeout=120)
    assert "handoff" in wide.stdout and "region-noworkers" in wide.stdout


@pytest.mark.slow
def test_quick_eval_end_to_end(tmp_path):
    out = tmp_path / "out"
    proc = run_krex("eval", "--quick", "--out", str(out), "--json", timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    doc = results.load(summary["results"])
    assert list(doc["summary"]) == list(MODES)
    assert {b["mode"] for b in doc["blocks"]} == set(MODES)
    for mode, s in doc["summary"].items():
        assert s["failed"] == 0 and s["commands"] > 0 and s["throughput_cpm"] > 0, mode
        assert s["timed_kernels"] == s["commands"] * 8, mode  # 2 kinds x (3 buckets + twin)
        assert s["rank_flips"]["flips"] <= s["rank_flips"]["comparisons"], mode
        for bucket, stats in s["inflation_pct"].items():
            assert stats["n"] > 0 and all(math.isfinite(stats[q]) for q in ("p50", "p95")), (
                mode, bucket)
    assert doc["summary"]["command"]["overlaps"] == 0
    assert doc["summary"]["region"]["overlaps"] == 0
    # Twins 3 % apart give candidate pairs (the machine's noise may push one out of 1-5 %).
    assert sum(s["rank_flips"]["comparisons"] for s in doc["summary"].values()) > 0
    # The "not clean" column can read non-zero: modes known to be contaminated do.
    for mode in ("none", "region-nofreeze", "region-noisolate"):
        assert doc["summary"][mode]["regions_not_clean"] > 0, mode
    assert all(v > 0 for v in doc["bound"]["per_mode_cpm"].values())
    assert os.path.exists(summary["table"])
    assert summary["plots"] or summary["plots_skipped"]


def test_not_clean_kernels_are_counted_by_reason():
    from krex.protocol.report import Reason

    block = _block()
    off = Reason.mechanism("freeze", "disabled by configuration", disabled=True).to_dict()
    block["commands"][0]["kernels"][0]["region"] = {"clean": False, "reasons": [off]}
    s = metrics.summarise_mode([block])
    assert s["regions_not_clean"] == 1 and s["timed_kernels"] == 2
    assert s["not_clean_reasons"] == {"mechanism_disabled (freeze)": 1}
    assert metrics.summarise_mode([_block()])["not_clean_reasons"] == {}  # clean: none


def _summary(infl_p95: float, drift_p95: float, not_clean: int = 0,
             reasons: dict | None = None) -> dict:
    return {"inflation_pct": {"0.1": {"p95": infl_p95}, "1": {"p95": 5.0}},
            "reference_drift_pct": {"0.1": {"p95": drift_p95}, "1": {"p95": 0.2}},
            "regions_not_clean": not_clean, "timed_kernels": 20,
            "not_clean_reasons": reasons or {}}


def test_console_notes_warn_below_the_noise_floor_and_explain_not_clean():
    """krex eval --quick said region 33 %, none -2.4 % at >= 0.1 ms while the machine's
    own drift reached 58 %: the console must say that this cannot be read."""
    doc = {"profile": {"buckets_ms": [0.1, 1.0]},
           "summary": {"region": _summary(33.0, 58.0, 1, {"holder_preempted": 1}),
                       "none": _summary(-2.4, 41.0)}}
    notes = results.console_notes(doc)
    floor = [n for n in notes if "noise floor" in n]
    assert len(floor) == 1 and "≥0.1 ms" in floor[0] and "58" in floor[0], notes
    assert "next:" in floor[0]
    assert any(n.startswith("not clean: region 1/20: holder_preempted ×1") for n in notes), notes
    # negative control: inflations well above the drift, all clean: nothing to say
    quiet = {"profile": {"buckets_ms": [0.1, 1.0]},
             "summary": {"region": _summary(0.5, 0.2), "none": _summary(90.0, 0.3)}}
    assert results.console_notes(quiet) == []


def test_eval_takes_gpu_devices_and_refuses_others():
    import argparse

    from krex.cli.eval_cmds import _config
    from krex.errors import BadRequest

    base = dict(modes=None, quick=True, agents=None, commands=None, rounds=None, profile=None,
                seed=0, timeout_s=60.0, no_stagger=False)
    for device in ("cpu", "fakegpu:0", "cuda:1", "rocm:0"):
        assert _config(argparse.Namespace(device=device, **base)).device == device
    for device in ("gpu:0", "cuda", "cuda:x"):
        with pytest.raises(BadRequest, match="cuda:N or rocm:N"):
            _config(argparse.Namespace(device=device, **base))


def test_gpu_kernels_one_per_bucket():
    from krex.eval.kernels import device_specs

    assert [(k.kind, k.size) for k in device_specs("cuda:0", (0.1, 1.0))] == [
        ("spin", 100), ("spin", 1000)]
    assert {k.kind for k in device_specs("rocm:0", (0.1,))} == {"sleep"}


CUDA_SPIN = """
import sys
from krex.eval.kernels import KernelSpec, build
from krex.measure.events import DriverEventTimer
timer = DriverEventTimer(0, sys.argv[1])
build(KernelSpec("spin-0.1ms", "spin", 0.1, 100), "cuda:0", timer.api.lib)()
timer.synchronize()
"""


def test_cuda_spin_kernel_is_valid_ptx_and_launches(tmp_path):
    """The PTX assembles for a current GPU (ptxas, when the toolkit is here), and the eval
    kernel of cuda:N launches through the driver API (fakegpu's driver here, in a child:
    a driver library loaded into the test process would stand in for every later
    ``libcuda.so.1``)."""
    import shutil
    import subprocess
    import sys

    from krex.devices import fakegpu, native
    from krex.eval.kernels import DEVICE_PTX

    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    if os.path.exists(ptxas):
        (tmp_path / "k.ptx").write_bytes(DEVICE_PTX)
        subprocess.run([ptxas, "-arch=sm_90", str(tmp_path / "k.ptx"), "-o",
                        str(tmp_path / "k.cubin")], check=True, capture_output=True)
    if not fakegpu.available():
        pytest.skip("fakegpu was not built")
    with fakegpu.FakeGpu() as gpu:
        done = subprocess.run([sys.executable, "-c", CUDA_SPIN,
                               str(native.fakegpu_lib_dir() / "libcuda.so.1")],
                              env=gpu.env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        assert gpu.stats()["launches"] == 1
