"""Statistics and stopping rules: pure functions, deterministic."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from krex.measure import stats
from krex.measure.stopping import (
    CONVERGED,
    COUNT,
    MAX_TIME,
    SETTLED,
    TIMEOUT,
    CountRule,
    NoiseRule,
)


def test_quantile_matches_numpy_linear():
    rng = random.Random(1)
    values = [rng.expovariate(1.0) for _ in range(101)]
    for q in (0.0, 0.1, 0.25, 0.5, 0.95, 0.99, 1.0):
        assert stats.quantile(values, q) == pytest.approx(float(np.quantile(values, q)))


def test_named_quantiles_share_the_one_definition():
    values = [float(v) for v in range(1, 21)]
    named = stats.quantiles(values)
    assert list(named) == ["p50", "p95", "p99"]
    assert named["p95"] == stats.quantile(values, 0.95) == pytest.approx(np.quantile(values, 0.95))
    assert stats.quantile_name(0.999) == "p99.9"
    # Non-finite values are left out; none at all reads NaN (not an exception).
    assert stats.quantiles([1.0, math.nan, 3.0], (0.5,)) == {"p50": 2.0}
    assert math.isnan(stats.quantiles([], (0.5,))["p50"])


def test_three_inflation_readings():
    alone = [1.0, 1.0, 1.0, 1.0, 2.0]  # a tick hit the reference once
    loaded = [1.0, 1.0, 1.0, 1.0, 2.0]  # the same distribution under load
    # Same distribution: every quantile reads 0, the reported median 0 ...
    assert stats.quantile_inflation_pct(loaded, alone) == {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    assert stats.reported_inflation_pct(loaded, alone) == 0.0
    # ... but per sample the tick counts against the reference median.
    per = stats.per_sample_inflation_pct(loaded, stats.median(alone))
    assert per == [0.0, 0.0, 0.0, 0.0, 100.0]
    # Negative control: a slower loaded run reads positive in every reading.
    slower = [v * 1.1 for v in loaded]
    assert stats.reported_inflation_pct(slower, alone) == pytest.approx(10.0)
    assert all(v == pytest.approx(10.0)
               for v in stats.quantile_inflation_pct(slower, alone).values())
    assert stats.inflation_pct(0.9, 1.0) == pytest.approx(-10.0)


def test_lower_median_is_torch_median():
    assert stats.lower_median([4, 1, 3, 2]) == 2  # torch.median picks the lower middle
    assert stats.lower_median([3, 1, 2]) == 2
    assert stats.median([4, 1, 3, 2]) == 2.5


def test_quantile_rejects_bad_input():
    with pytest.raises(ValueError):
        stats.quantile([], 0.5)
    with pytest.raises(ValueError):
        stats.quantile([1.0], 1.5)


def test_relative_noise_ignores_one_outlier_but_stdev_does_not():
    values = [1.0 + 0.01 * math.sin(i) for i in range(200)] + [50.0]
    assert stats.relative_noise(values) < 0.02
    assert stats.relative_stdev(values) > 1.0


def test_relative_noise_of_normal_samples_estimates_sigma():
    rng = random.Random(2)
    values = [rng.gauss(10.0, 0.2) for _ in range(5000)]
    assert stats.relative_noise(values) == pytest.approx(0.02, rel=0.1)


def test_slope():
    assert stats.slope([1, 2, 3, 4]) == pytest.approx(1.0)
    assert stats.slope([5, 5, 5]) == 0.0


def test_median_ci_covers_the_median_at_its_confidence():
    rng = random.Random(3)
    trials, covered = 2000, 0
    for _ in range(trials):
        values = [rng.gauss(0.0, 1.0) for _ in range(25)]
        low, high = stats.median_ci(values, 0.95)
        covered += low <= 0.0 <= high
    assert 0.93 <= covered / trials <= 0.995


def test_median_ci_narrows_with_more_samples():
    rng = random.Random(4)
    small = [rng.gauss(0, 1) for _ in range(20)]
    large = [rng.gauss(0, 1) for _ in range(2000)]
    assert np.ptp(stats.median_ci(large)) < np.ptp(stats.median_ci(small)) / 4


def test_summarize_keys():
    s = stats.summarize([1.0, 2.0, 3.0, 4.0])
    assert s["min_ms"] == 1.0 and s["max_ms"] == 4.0 and s["mean_ms"] == 2.5
    assert set(s) >= {"median_ms", "p95_ms", "p99_ms", "noise_rel", "stdev_rel"}


def _run(rule, durations, overhead_ms=0.0):
    samples, clock_s = [], 0.0
    for d in durations:
        samples.append(d)
        clock_s += (d + overhead_ms) / 1e3
        reason = rule.decide(samples, clock_s)
        if reason:
            return reason, samples
    return None, samples


def _gauss(mean_ms, rel, seed=0):
    rng = random.Random(seed)
    while True:
        yield mean_ms * (1 + rng.gauss(0, rel))


def test_noise_rule_converges_after_min_time():
    reason, samples = _run(NoiseRule(noise_target=0.005, min_time_s=0.1), _gauss(1.0, 0.001))
    assert reason == CONVERGED
    assert sum(samples) / 1e3 >= 0.1
    assert len(samples) < 150


def test_noise_rule_stops_when_noise_settles_above_target():
    rule = NoiseRule(noise_target=0.005, min_time_s=0.1, max_time_s=10.0, timeout_s=100)
    reason, samples = _run(rule, _gauss(1.0, 0.03))
    assert reason == SETTLED
    assert sum(samples) / 1e3 < 2.0  # well before max_time: more samples would not help


def test_noise_rule_keeps_going_while_noise_drifts():
    def ramp():
        i = 0
        while True:
            i += 1
            yield 1.0 + 0.002 * i  # the spread keeps growing: never settled

    reason, _ = _run(NoiseRule(noise_target=0.001, max_time_s=0.5, timeout_s=100), ramp())
    assert reason == MAX_TIME


def test_noise_rule_times_out_on_wall_time_including_overheads():
    rule = NoiseRule(noise_target=0.0001, min_time_s=0.5, max_time_s=1.0, timeout_s=0.2)
    reason, samples = _run(rule, _gauss(1.0, 0.05), overhead_ms=9.0)
    assert reason == TIMEOUT
    assert sum(samples) / 1e3 < 0.05  # measured time is small; the wall clock ran out


def test_count_rule():
    reason, samples = _run(CountRule(7), _gauss(1.0, 0.0))
    assert reason == COUNT and len(samples) == 7
    reason, _ = _run(CountRule(10_000, timeout_s=0.05), _gauss(1.0, 0.0))
    assert reason == TIMEOUT
