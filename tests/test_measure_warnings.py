"""Calibrated warnings: a quiet measurement raises none; each warning fires when it should.

Real CpuTimer, real regions through a real daemon.  The thresholds are the timer's
measured resolution (``TOO_SHORT_FOR_TIMER``: 100 x it) and the median's own
95 % interval (``UNSTABLE``: wider than the noise target after sampling stopped
unconverged) — see docs/measure.md, "Warnings".
"""

from __future__ import annotations

import random
import time

import pytest
from helpers import clean_but_contention

import krex
from krex.measure import CpuTimer, MeasureWarning, checks

W = MeasureWarning


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def test_a_quiet_1ms_measurement_raises_no_warning(daemon):
    m = krex.measure(lambda: _busy(1.0))
    if not m.region.clean and clean_but_contention(m.region):
        pytest.skip(f"the machine is not quiet: {m.region.why_not_clean()}")
    assert m.warnings == [], m.warning_details
    assert m.trusted and m.region.clean
    assert 0.9 < m.median_ms < 1.5


def test_unstable_fires_when_the_median_is_uncertain(daemon):
    rng = random.Random(1)  # uniform over 0.5-1.5 ms: ±35 % per sample, robustly
    m = krex.measure(lambda: _busy(rng.uniform(0.5, 1.5)), cache="hot", max_time_s=0.2)
    assert W.UNSTABLE in m.warnings, (m.stop_reason, m.noise_rel)
    assert "median ±" in m.warning_details["UNSTABLE"] and m.stop_reason == "max_time"


def test_too_short_fires_below_100_timer_resolutions(daemon):
    m = krex.measure(lambda: None, cache="hot", max_time_s=0.2)
    assert W.TOO_SHORT_FOR_TIMER in m.warnings
    floor_ms = checks.TIMER_RESOLUTION_FACTOR * CpuTimer().resolution_ms
    assert m.median_ms < floor_ms < 0.1  # the floor is well under the docs' 1 ms example


def test_cold_cache_hint_when_the_flush_dominates(daemon):
    m = krex.measure(lambda: sum(range(2_000)), max_time_s=0.2)
    assert m.hints and m.hints[0].startswith("cold_cache:")
    assert "cache='hot'" in m.hints[0]
    assert not any("flush" in d for d in m.warning_details.values())  # cost, not trust
    hot = krex.measure(lambda: sum(range(2_000)), cache="hot", max_time_s=0.2)
    assert hot.hints == [] and hot.flush_bytes is None
