"""compare(): interleaved A/B in one region, paired interval, verdicts."""

from __future__ import annotations

import math
import pickle

import pytest

from krex.measure import FakeTimer, MeasureWarning, ScriptedRegions, compare
from krex.measure.compare import verdict
from krex.protocol.report import Reason, ReasonCode


def _pair(ratio, noise_rel=0.01, seed=0, drift=None, **timer_kwargs):
    timer = FakeTimer(seed=seed, **timer_kwargs)
    a = timer.kernel(1.0, noise_rel=noise_rel, drift=drift)
    b = timer.kernel(1.0 * ratio, noise_rel=noise_rel, drift=drift)
    return timer, a, b, ScriptedRegions(clock=timer.now_s)


def test_verdict_rules():
    assert verdict(1.02, 1.06, 0.01) == "faster"
    assert verdict(0.94, 0.98, 0.01) == "slower"
    assert verdict(0.995, 1.004, 0.01) == "same"
    assert verdict(0.97, 1.03, 0.01) == "unclear"
    assert verdict(1.002, 1.008, 0.01) == "same"  # significant but inside the band


@pytest.mark.parametrize("seed", range(5))
def test_clear_five_percent_slower_candidate(seed):
    timer, a, b, regions = _pair(1.05, seed=seed)
    c = compare(a, b, timer=timer, region=regions)
    assert c.verdict == "slower"
    assert c.ci_low <= 1 / 1.05 <= c.ci_high
    assert c.stop_reason == "clear" and c.pairs < 100  # stopped early
    assert regions.taken == 1


@pytest.mark.parametrize("seed", range(5))
def test_clear_five_percent_faster_candidate(seed):
    timer, a, b, regions = _pair(1 / 1.05, seed=seed)
    c = compare(a, b, timer=timer, region=regions)
    assert c.verdict == "faster" and c.speedup == pytest.approx(1.05, rel=0.01)


@pytest.mark.parametrize("seed", range(5))
def test_tenth_of_a_percent_is_same_or_unclear(seed):
    timer, a, b, regions = _pair(1.001, seed=seed)
    c = compare(a, b, timer=timer, region=regions, same_within=0.01)
    assert c.verdict in ("same", "unclear")


def test_tiny_difference_with_quiet_kernels_is_same():
    timer, a, b, regions = _pair(1.001, noise_rel=0.002)
    c = compare(a, b, timer=timer, region=regions, same_within=0.01)
    assert c.verdict == "same" and c.stop_reason == "clear"


def test_drift_between_minutes_cancels_within_pairs():
    # the whole machine slows by up to 30 % over the run: pairs still see 5 %
    def drift(clock_s):
        return 1.0 + 0.3 * math.sin(clock_s * 20)

    timer, a, b, regions = _pair(1.05, noise_rel=0.01, drift=drift)
    c = compare(a, b, timer=timer, region=regions)
    assert c.verdict == "slower" and c.speedup == pytest.approx(1 / 1.05, rel=0.01)


def test_outliers_do_not_move_the_verdict():
    timer = FakeTimer()
    a = timer.kernel(durations_ms=[1.0] * 9 + [60.0])  # a scheduler hit every 10 calls
    b = timer.kernel(durations_ms=[1.05] * 7 + [80.0, 1.05, 1.05, 1.05])
    c = compare(a, b, timer=timer, region=ScriptedRegions(clock=timer.now_s))
    assert c.verdict == "slower" and c.speedup == pytest.approx(1 / 1.05, rel=0.001)


def test_noisy_and_close_is_unclear_at_the_time_limit():
    timer, a, b, regions = _pair(1.01, noise_rel=0.2)
    c = compare(a, b, timer=timer, region=regions, same_within=0.001, max_time_s=0.2)
    assert c.verdict == "unclear" and c.stop_reason == "max_time"
    assert MeasureWarning.UNSTABLE in c.warnings


def test_random_order_is_seeded_and_works():
    timer, a, b, regions = _pair(1.05)
    c = compare(a, b, timer=timer, region=regions, order="random", seed=3)
    assert c.verdict == "slower" and c.order == "random"
    with pytest.raises(ValueError):
        compare(a, b, timer=timer, region=regions, order="sideways")


def test_comparison_carries_region_and_pickles():
    timer, a, b, regions = _pair(1.05)
    c = compare(a, b, timer=timer, region=regions)
    assert c.region.clean is True and c.warnings == []
    again = pickle.loads(pickle.dumps(c))
    d = again.to_dict()
    assert d["verdict"] == "slower" and d["pairs"] == len(d["baseline_samples_ms"])
    assert d["baseline"]["median_ms"] == pytest.approx(1.0, rel=0.01)


def test_not_clean_comparison_is_retried():
    timer, a, b, _ = _pair(1.05)
    failed = Reason(ReasonCode.STEP_FAILED, "isolate: OSError")
    regions = ScriptedRegions([{"reasons": [failed]}, {}], clock=timer.now_s)
    c = compare(a, b, timer=timer, region=regions)
    assert c.attempts == 2 and c.warnings == []


def _work(n):
    def fn():
        return sum(range(n))

    return fn


def test_cpu_ten_percent_slower_copy_is_slower_in_repeated_runs():
    """Real CpuTimer, trivial region.  Majority of 3 runs: the 2-core machine is noisy."""
    base, slow = _work(20_000), _work(22_000)
    verdicts = []
    for seed in range(3):
        c = compare(
            base,
            slow,
            device="cpu",
            cache="hot",
            region=ScriptedRegions(),
            seed=seed,
            warmup_ms=10,
            max_time_s=1.0,
            timeout_s=3.0,
        )
        verdicts.append(c.verdict)
        if c.verdict == "slower":
            assert 0.8 < c.speedup < 0.97
    assert verdicts.count("slower") >= 2, verdicts
    assert "faster" not in verdicts, verdicts


def test_bench_measure_and_compare_refuse_the_same_bad_options():
    """One options object: compare used to run hot, silently, with cache="warm"."""
    from krex.measure import bench, measure

    timer, a, b, regions = _pair(1.0)
    for call in (lambda **kw: compare(a, b, timer=timer, region=regions, **kw),
                 lambda **kw: measure(a, timer=timer, region=regions, **kw),
                 lambda **kw: bench(a, timer=timer, region=regions, **kw)):
        for bad in ({"cache": "warm"}, {"retries": -1}, {"timeout_s": 0}):
            with pytest.raises(ValueError):
                call(**bad)
    assert compare(a, b, timer=timer, region=regions, cache="hot").pairs > 0  # a good one runs
