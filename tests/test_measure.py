"""measure() and bench(): stopping, warnings, regions and the do_bench contract.

Deterministic parts use the FakeTimer and scripted regions; the cpu-device
parts use the real CpuTimer with an injected trivial region.
"""

from __future__ import annotations

import json
import pickle
import warnings

import numpy as np
import pytest

from krex.errors import RegionRevoked
from krex.measure import (
    BenchWarning,
    FakeTimer,
    LocalRegion,
    Measurement,
    MeasureWarning,
    ScriptedRegions,
    bench,
    measure,
)
from krex.measure import regions as regions_mod
from krex.measure.stopping import CountRule
from krex.protocol.report import DeviceAudit, Outcome, Reason, ReasonCode, RegionReport

W = MeasureWarning
# A region the daemon saw interfered with (a failed step: not a structural gap).
NOT_CLEAN = {"reasons": [Reason(ReasonCode.STEP_FAILED, "freeze: revert: OSError")]}
CLEAN = {"reasons": []}


def _fake(ms=1.0, noise_rel=0.001, seed=0, **timer_kwargs):
    timer = FakeTimer(seed=seed, **timer_kwargs)
    return timer, timer.kernel(ms, noise_rel=noise_rel), ScriptedRegions(clock=timer.now_s)


# --- stopping ---------------------------------------------------------------------------


def test_quiet_kernel_converges_and_is_trusted():
    timer, kernel, regions = _fake(1.0, 0.001)
    m = measure(kernel, timer=timer, region=regions)
    assert m.stop_reason == "converged"
    assert m.median_ms == pytest.approx(1.0, rel=0.002)
    assert m.noise_rel < 0.005 and m.iterations >= 100  # min_time_s = 0.1 s of samples
    assert m.warnings == [] and m.trusted


def test_noisy_kernel_stops_when_noise_settles_and_its_median_is_known():
    timer, kernel, regions = _fake(1.0, 0.03)
    m = measure(kernel, timer=timer, region=regions, max_time_s=5.0, timeout_s=50.0)
    assert m.stop_reason == "settled"
    assert sum(m.samples_ms) < 2000  # far from max_time: stopped on settled noise
    assert m.noise_rel == pytest.approx(0.03, rel=0.25)
    # 3 % per sample, but the median is known to within the 0.5 % target: no warning
    assert W.UNSTABLE not in m.warnings and m.trusted


def test_a_median_left_uncertain_by_the_budget_warns_unstable():
    timer, kernel, regions = _fake(1.0, 0.30)
    m = measure(kernel, timer=timer, region=regions, max_time_s=0.5, timeout_s=50.0)
    assert m.stop_reason == "max_time"
    assert W.UNSTABLE in m.warnings and "max_time" in m.warning_details["UNSTABLE"]
    assert "max_time_s" in W.UNSTABLE.next_action


def test_timeout_counts_wall_time_including_flushes():
    timer, kernel, regions = _fake(1.0, 0.05, host_overhead_ms=10.0)
    m = measure(
        kernel,
        timer=timer,
        region=regions,
        noise_target=1e-6,
        min_time_s=1.0,
        max_time_s=2.0,
        timeout_s=0.5,
    )
    assert m.stop_reason == "timeout"
    assert m.elapsed_s == pytest.approx(0.5, rel=0.2)
    assert W.UNSTABLE in m.warnings


def test_max_time_bounds_the_hold_flushes_included():
    timer = FakeTimer(host_overhead_ms=0.5)  # flush, start and stop: 1.5 ms per sample
    kernel = timer.kernel(1.0, noise_rel=0.0, drift=lambda s: 1.0 + s)  # ever noisier
    regions = ScriptedRegions(clock=timer.now_s)
    m = measure(kernel, timer=timer, region=regions, noise_target=1e-6, max_time_s=0.3,
                timeout_s=100)
    assert m.stop_reason == "max_time"
    held_s = regions.reports[-1].held_s
    assert 0.29 <= held_s <= 0.3  # the last batch was cut to what fits: never over
    assert sum(m.samples_ms) / 1e3 < 0.5 * held_s  # most of the hold went to flushes
    assert m.overhead_ms == pytest.approx(1.5, rel=0.05)


def test_the_daemons_granted_hold_is_a_ceiling_for_the_budget():
    timer = FakeTimer()
    kernel = timer.kernel(1.0, noise_rel=0.0, drift=lambda s: 1.0 + s)

    class Granted(regions_mod._ScriptedRegion):
        grant = {"max_hold_s": 0.25}

    owner = ScriptedRegions(clock=timer.now_s)
    m = measure(kernel, timer=timer, region=lambda d, **kw: Granted(owner, d, {}, None),
                noise_target=1e-6, max_time_s=2.0, timeout_s=100)
    assert m.stop_reason == "max_time"
    assert owner.reports[-1].held_s <= 0.25 - 0.05 + 0.002  # ceiling less the slack


# --- the region: only around the timed loop, retried when not clean ----------------------


def test_region_is_taken_around_the_timed_loop_only():
    timer, kernel, _ = _fake(1.0, 0.0)
    calls_at = {}

    class Spy(LocalRegion):
        def __enter__(self):
            calls_at["enter"] = kernel.calls
            return super().__enter__()

        def __exit__(self, *exc):
            calls_at["exit"] = kernel.calls
            super().__exit__(*exc)

    m = measure(kernel, timer=timer, region=Spy, warmup_ms=25, rep_ms=50)
    assert m.warmup_iterations == 25
    assert calls_at["enter"] == 1 + 5 + 25  # first call, estimate, warm-up: outside
    # in-region warm-up, then do_bench's count: rep / (call + flush and marks, 3 x 1 us)
    assert calls_at["exit"] - calls_at["enter"] == 1 + int(50 / 1.003)


def test_not_clean_region_is_retried_then_clean():
    timer, kernel, _ = _fake()
    regions = ScriptedRegions([NOT_CLEAN, CLEAN], clock=timer.now_s)
    m = measure(kernel, timer=timer, region=regions)
    assert regions.taken == 2 and m.attempts == 2
    assert len(m.rejected_regions) == 1 and m.rejected_regions[0].clean is False
    assert W.REGION_NOT_CLEAN not in m.warnings and m.region.clean is True


def test_region_never_clean_is_warned_after_retries():
    timer, kernel, _ = _fake()
    regions = ScriptedRegions([NOT_CLEAN], clock=timer.now_s)
    m = measure(kernel, timer=timer, region=regions, retries=3)
    assert regions.taken == 4 and m.attempts == 4
    assert W.REGION_NOT_CLEAN in m.warnings
    assert "freeze: revert: OSError" in m.warning_details["REGION_NOT_CLEAN"]
    assert m.to_dict()["warnings"][0]["next_action"]


def test_structural_gaps_are_not_retried_and_say_enforcement_impossible():
    timer, kernel, _ = _fake()
    gap = {"reasons": [Reason.mechanism("freeze", "no cgroup")]}
    regions = ScriptedRegions([gap], clock=timer.now_s)
    m = measure(kernel, timer=timer, region=regions, retries=3)
    assert regions.taken == 1
    assert W.ENFORCEMENT_IMPOSSIBLE in m.warnings
    assert "freeze: no cgroup" in m.warning_details["ENFORCEMENT_IMPOSSIBLE"]


def test_without_a_daemon_the_measurement_says_enforcement_was_impossible():
    timer, kernel, _ = _fake()
    m = measure(kernel, timer=timer, region=LocalRegion)
    assert m.region.mode == "none" and m.region.held_s >= 0
    assert [r.code for r in m.region.reasons] == [ReasonCode.NO_DAEMON]
    assert W.ENFORCEMENT_IMPOSSIBLE in m.warnings and W.REGION_NOT_CLEAN not in m.warnings


def test_revoked_region_is_retried():
    timer, kernel, _ = _fake()
    revoked = {"outcome": Outcome.REVOKED, "reasons": [Reason(ReasonCode.REVOKED, "held long")]}
    regions = ScriptedRegions([revoked, {}], clock=timer.now_s)
    m = measure(kernel, timer=timer, region=regions)
    assert m.attempts == 2 and m.warnings == []


def test_region_revoked_error_on_exit_becomes_a_warning():
    timer, kernel, _ = _fake()

    class Revoking(LocalRegion):
        def __exit__(self, *exc):
            raise RegionRevoked("held too long", region=7)

    m = measure(kernel, timer=timer, region=Revoking, retries=0)
    assert m.region.revoked is True and m.region.clean is False
    assert W.REGION_REVOKED in m.warnings and "held too long" in m.warning_details["REGION_REVOKED"]


def test_region_factory_hook(monkeypatch):
    timer, kernel, _ = _fake()
    regions = ScriptedRegions(clock=timer.now_s)
    monkeypatch.setattr(regions_mod, "_factory", None)
    regions_mod.set_region_factory(regions)
    try:
        measure(kernel, timer=timer)
    finally:
        regions_mod.set_region_factory(None)
    assert regions.taken == 1


def test_nested_region_report_is_not_judged():
    timer, kernel, _ = _fake()
    nested = {"nested": True, "outcome": Outcome.NESTED, "mode": None}
    regions = ScriptedRegions([nested], clock=timer.now_s)
    m = measure(kernel, timer=timer, region=regions)
    assert m.warnings == [] and m.region.clean is None


# --- plausibility, timer resolution, throttling -------------------------------------------


def test_samples_longer_than_the_hold_are_flagged_not_returned_silently():
    timer, kernel, _ = _fake()
    regions = ScriptedRegions([{"held_s": 0.001}], clock=timer.now_s)
    m = measure(kernel, timer=timer, region=regions)
    assert W.PLAUSIBILITY_FAILED in m.warnings and not m.trusted
    assert "held 0.001000 s" in m.warning_details["PLAUSIBILITY_FAILED"]


def test_negative_samples_are_flagged():
    timer = FakeTimer()
    kernel = timer.kernel(durations_ms=[1.0, 1.0, -0.5, 1.0])
    m = measure(kernel, timer=timer, region=ScriptedRegions(clock=timer.now_s), rep_ms=20)
    assert W.PLAUSIBILITY_FAILED in m.warnings


def test_too_short_for_the_timer():
    timer, kernel, regions = _fake(0.01, 0.0, resolution_ms=0.001)
    m = measure(kernel, timer=timer, region=regions, rep_ms=5)
    assert W.TOO_SHORT_FOR_TIMER in m.warnings


def test_throttle_reported_by_the_region():
    timer, kernel, _ = _fake()
    thermal = DeviceAudit("nvml", {"throttle_reasons": 0}, {"throttle_reasons": 0x40})
    regions = ScriptedRegions([{"device_audit": thermal}], clock=timer.now_s)
    m = measure(kernel, timer=timer, region=regions)
    assert W.THROTTLED in m.warnings and "0x40" in m.warning_details["THROTTLED"]
    idle = DeviceAudit("nvml", {"throttle_reasons": 0x1}, {"throttle_reasons": 0x1})
    quiet = measure(kernel, timer=timer, region=ScriptedRegions([{"device_audit": idle}],
                                                                  clock=timer.now_s))
    assert W.THROTTLED not in quiet.warnings  # idle is not throttling


def test_every_warning_has_a_next_action():
    for w in MeasureWarning:
        assert w.summary and w.next_action


# --- the result -----------------------------------------------------------------------------


def test_measurement_pickles_and_serialises():
    timer, kernel, regions = _fake(1.0, 0.01)
    m = measure(kernel, timer=timer, region=regions, label="k1")
    again = pickle.loads(pickle.dumps(m))
    assert isinstance(again, Measurement) and again.samples_ms == m.samples_ms
    d = json.loads(json.dumps(m.to_dict()))
    assert d["iterations"] == m.iterations and d["region"]["clean"] is True
    assert RegionReport.from_dict(d["region"]) == m.region
    assert d["label"] == "k1" and d["format"] == 2
    for key in ("min_ms", "median_ms", "mean_ms", "p95_ms", "p99_ms", "noise_rel"):
        assert key in d


def test_bad_cache_mode():
    timer, kernel, regions = _fake()
    with pytest.raises(ValueError):
        measure(kernel, timer=timer, region=regions, cache="lukewarm")


def test_cold_flushes_every_sample_hot_never():
    timer, kernel, regions = _fake()
    m = measure(kernel, timer=timer, region=regions, rep_ms=30, cache="cold")
    assert timer.flushes >= m.iterations
    timer, kernel, regions = _fake()
    measure(kernel, timer=timer, region=regions, rep_ms=30, cache="hot")
    assert timer.flushes == 0


# --- the do_bench contract ----------------------------------------------------------------


def _scripted_bench(durations_ms=(1.0, 2.0, 3.0, 4.0, 10.0), overhead_ms=0.0, **kwargs):
    """bench of a deterministic fake kernel: the same call gives the same samples."""
    timer = FakeTimer(host_overhead_ms=overhead_ms)
    kernel = timer.kernel(durations_ms=durations_ms)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean fake region: no warnings at all
        return bench(kernel, timer=timer, region=ScriptedRegions(clock=timer.now_s), **kwargs)


def test_bench_return_modes_follow_do_bench():
    times = _scripted_bench(return_mode="all")
    assert isinstance(times, list) and len(times) > 10
    assert _scripted_bench() == pytest.approx(float(np.mean(times)))  # default: mean
    assert _scripted_bench(return_mode="min") == pytest.approx(min(times))
    assert _scripted_bench(return_mode="max") == pytest.approx(max(times))
    lower_median = sorted(times)[(len(times) - 1) // 2]  # torch.median: the lower middle
    assert _scripted_bench(return_mode="median") == pytest.approx(lower_median)
    assert isinstance(_scripted_bench(return_mode="mean"), float)


def test_bench_quantiles_follow_torch_quantile():
    times = _scripted_bench(return_mode="all")
    q = _scripted_bench(quantiles=[0.2, 0.5, 0.8])
    assert q == pytest.approx(list(np.quantile(times, [0.2, 0.5, 0.8])))
    single = _scripted_bench(quantiles=[0.5])
    assert isinstance(single, float) and single == pytest.approx(float(np.median(times)))


def test_bench_budgets_set_counts():
    assert len(_scripted_bench([1.0], return_mode="all")) == 100  # rep=100 ms of 1 ms calls
    assert len(_scripted_bench([1.0], rep=40, return_mode="all")) == 40
    assert len(_scripted_bench([2.0], rep=40, return_mode="all")) == 20
    assert len(_scripted_bench([1.0], rep=0.1, return_mode="all")) == 1  # at least one


def test_bench_counts_include_the_flush_as_do_bench_estimates():
    # triton's estimate times cache clear + fn: 3 host operations of 0.25 ms + 1 ms per sample
    assert len(_scripted_bench([1.0], overhead_ms=0.25, rep=35, return_mode="all")) == 20


def test_bench_counts_follow_the_samples_in_the_region_not_a_slow_estimate_outside():
    # Outside the region a busy host makes every call 10x slower than inside (the first call,
    # the 5 estimate samples, the warm-up): do_bench's count from that estimate is 10 where
    # the 100 ms budget holds about 90 samples of 1 ms.  On fakegpu under load a 0.1 ms kernel
    # so got 1-15 samples, and their median was the region's first, slowest ones (issue 41).
    import itertools

    from krex.measure.timers import FakeKernel

    timer = FakeTimer(host_overhead_ms=0.01)
    outside = 1 + 5 + 1  # first call, estimate, one warm-up call (warmup=10 ms of 10 ms)
    kernel = FakeKernel(timer, itertools.chain([10.0] * outside, itertools.repeat(1.0)))
    times = bench(kernel, timer=timer, region=ScriptedRegions(clock=timer.now_s), warmup=10,
                  rep=100, return_mode="all")
    assert 80 <= len(times) <= 101 and times == pytest.approx([1.0] * len(times)), len(times)
    # control: the rule without the budget to refit from keeps the estimate's count
    rule = CountRule(10)
    rule.refit(1.0)
    assert rule.count == 10
    refit = CountRule(10, rep_ms=100)
    refit.refit(1.0)
    refit.refit(2.0)  # a slower batch later never lowers it: the hold bounds the time
    assert refit.count == 100


def test_bench_rejects_unknown_return_mode():
    with pytest.raises(ValueError):
        _scripted_bench(return_mode="p50")


def test_bench_clears_grads():
    class Tensor:
        grad = "stale"

    x = Tensor()
    seen = []
    timer = FakeTimer()
    kernel = timer.kernel(1.0)

    def fn():
        seen.append(x.grad)
        kernel()

    bench(fn, rep=10, grad_to_none=[x], timer=timer, region=ScriptedRegions(clock=timer.now_s))
    assert seen[-1] is None


def test_bench_issues_python_warnings_for_measurement_warnings():
    timer, kernel, _ = _fake()
    with pytest.warns(BenchWarning, match="enforced"):
        bench(kernel, rep=10, timer=timer, region=LocalRegion)


def test_clock_drop_across_the_loop_is_throttling():
    timer, kernel, regions = _fake()
    timer.clock_script = [{"sm_mhz": 1980.0}, {"sm_mhz": 1400.0}]
    m = measure(kernel, timer=timer, region=regions)
    assert W.THROTTLED in m.warnings and "sm_mhz fell" in m.warning_details["THROTTLED"]
    assert m.clocks_start == {"sm_mhz": 1980.0} and m.clocks_end == {"sm_mhz": 1400.0}


def test_krex_measure_is_the_function_and_the_package():
    import krex

    assert krex.measure.stats.quantile([1.0, 2.0, 3.0], 0.5) == 2.0  # the package ...
    timer, kernel, regions = _fake()
    m = krex.measure(kernel, timer=timer, region=regions)  # ... called, the function
    assert isinstance(m, Measurement) and m.region.clean is True
    from krex import measure as via_from

    assert via_from is krex.measure and callable(via_from)
    with pytest.raises(TypeError):
        krex.measure(kernel, 5)  # keyword-only after fn, as the function itself


def test_a_bad_device_is_the_same_unknown_device_error_as_krex_region():
    from krex.client.region import Region
    from krex.errors import UnknownDevice

    with pytest.raises(UnknownDevice) as from_measure:
        measure(lambda: None, device="bogus")
    with pytest.raises(UnknownDevice) as from_region:
        Region("bogus")
    assert from_measure.value.message == from_region.value.message


def test_bench_issues_the_cold_cache_hint_once_per_process(monkeypatch):
    import sys

    from krex.measure import BenchCostHint

    bench_mod = sys.modules["krex.measure.bench"]  # the package's `bench` is the function
    monkeypatch.setattr(bench_mod, "_HINTED", set())
    timer = FakeTimer(host_overhead_ms=1.0)  # flush and marks: 3 ms per 1 ms call
    kernel = timer.kernel(1.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            bench(kernel, rep=20, timer=timer, region=ScriptedRegions(clock=timer.now_s))
    hints = [w for w in seen if issubclass(w.category, BenchCostHint)]
    assert len(hints) == 1 and "cache='hot'" in str(hints[0].message)
    with warnings.catch_warnings(record=True) as seen:  # negative control: hot cache
        warnings.simplefilter("always")
        monkeypatch.setattr(bench_mod, "_HINTED", set())
        bench(kernel, rep=20, timer=timer, cache="hot", region=ScriptedRegions(clock=timer.now_s))
    assert not [w for w in seen if issubclass(w.category, BenchCostHint)]


def test_compare_estimate_calls_sets_the_calls_before_the_region():
    """Fewer estimate samples: fewer calls outside the region, the same samples inside."""
    from krex.measure import compare

    def calls_outside(estimate_calls):
        timer, kernel, regions = _fake(1.0, 0.001)
        counts = {"outside": 0, "in": 0}
        seen_regions = [0]

        def fn():
            counts["in" if regions.taken > seen_regions[0] else "outside"] += 1
            return kernel()

        c = compare(fn, fn, timer=timer, region=regions, cache="hot", warmup_ms=1.0,
                    estimate_calls=estimate_calls)
        return counts["outside"], c

    fewer, c2 = calls_outside(2)
    default, c5 = calls_outside(5)
    assert default - fewer == 2 * 3  # (first call + 5 samples + warm-up) vs (... + 2 ...)
    assert c2.verdict == c5.verdict == "same"
    none, c0 = calls_outside(0)  # no estimate: the first call and a 1 ms warm-up per side
    assert 2 * 2 <= none <= 2 * 3 and c0.verdict == "same"  # (1 ms ± 0.1 %: one or two)
    with pytest.raises(ValueError, match="estimate_calls"):
        compare(lambda: None, lambda: None, estimate_calls=-1)


@pytest.mark.parametrize("b_ms, verdict, pairs", [(0.5, "faster", 10), (1.0, "same", 30)])
def test_compare_without_an_estimate_looks_on_the_floors(b_ms, verdict, pairs):
    """``estimate_calls=0`` sizes the groups between looks from the blocks measured in the
    region and cuts them so that a look falls on the early floor and on ``min_pairs``: a
    clear effect stops at exactly ``early_pairs``, a clear ``same`` at ``min_pairs``, not
    a group later (with 1 ms samples a group is one block, 2 pairs, after the first look)."""
    from krex.measure import compare

    timer = FakeTimer(seed=1)
    a, b = timer.kernel(1.0, noise_rel=0.001), timer.kernel(b_ms, noise_rel=0.001)
    c = compare(a, b, timer=timer, region=ScriptedRegions(clock=timer.now_s), cache="hot",
                estimate_calls=0, warmup_ms=1.0, min_pairs=30, early_pairs=10, min_time_s=0.005,
                same_within=0.06, decisive_only=True, same_at_confidence=True)
    assert (c.verdict, c.pairs) == (verdict, pairs)
