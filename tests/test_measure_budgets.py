"""Budgets are budgets: every time budget of bench / measure / compare bounds the region's
hold, as the daemon records it, within the documented slack (docs/measure.md).

Real timers, real regions through a real daemon, the default cold cache (so the flush
before each sample is inside the hold).  The slack is ``HOLD_SLACK_S`` plus the longest
sample seen (a sample is never cut in half).  Each bound has a negative control: a
larger budget holds well past the smaller bound, so the reading can fail.
"""

from __future__ import annotations

import time
import warnings

import pytest

import krex
from krex.measure import loop

BUDGET_S = 0.3


def kernel():
    return sum(range(20_000))


def other():
    return sum(range(20_000))


def _slack_s(samples_ms, overhead_ms):
    return loop.HOLD_SLACK_S + (max(samples_ms) + (overhead_ms or 0.0)) / 1e3


def test_compare_holds_its_region_within_max_time_plus_slack(daemon):
    holds = []
    for _ in range(3):
        c = krex.compare(kernel, other, max_time_s=BUDGET_S)
        slack = _slack_s(c.baseline_samples_ms + c.candidate_samples_ms, c.overhead_ms)
        holds.append(c.region.held_s)
        assert c.region.held_s <= BUDGET_S + slack, (holds, slack)
        assert c.flush_bytes and c.overhead_ms > 0  # the flush cost is reported
    # negative control: a budget the comparison cannot finish early in holds past the bound
    c = krex.compare(kernel, other, max_time_s=1.0, timeout_s=1.0, confidence=0.999999,
                     same_within=0.0)
    assert c.stop_reason == "max_time"
    assert c.region.held_s > BUDGET_S + loop.HOLD_SLACK_S + 0.3


def test_measure_and_bench_budgets_bound_the_hold(daemon):
    m = krex.measure(kernel, max_time_s=BUDGET_S, noise_target=1e-9)  # never converges
    assert m.stop_reason == "max_time"
    assert BUDGET_S - 0.1 < m.region.held_s <= BUDGET_S + _slack_s(m.samples_ms,
                                                                     m.overhead_ms)
    # bench's rep (do_bench's budget, ms) bounds the hold after the in-region warm-up
    m = krex.measure(kernel, rep_ms=100)
    warm_s = max(1.0, m.estimate_ms) / 1e3
    assert m.region.held_s <= 0.1 + warm_s + _slack_s(m.samples_ms, m.overhead_ms)
    assert m.stop_reason in ("count", "max_time")


@pytest.fixture
def short_ceiling(make_daemon):
    return make_daemon("--max-hold-s", "0.5")


def _busy(ms: float = 1.0) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def test_max_hold_s_is_a_ceiling_clients_cannot_exceed(short_ceiling):
    # a client asking for 10 s gets the operator's 0.5 s, and is revoked past it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the RegionRevokedWarning
        with krex.region(max_hold_s=10.0) as r:
            assert r.grant["max_hold_s"] == 0.5
            time.sleep(0.8)
    assert r.report.revoked is True and r.report.clean is False
    # a measurement whose budget is above the ceiling ends before it: not revoked
    m = krex.measure(_busy, max_time_s=3.0, timeout_s=5.0, noise_target=1e-9)
    assert not m.region.revoked, m.region
    assert m.stop_reason == "max_time" and m.region.held_s <= 0.5
    assert "REGION_REVOKED" not in [w.name for w in m.warnings]


def test_a_request_under_the_ceiling_is_kept(short_ceiling):
    with krex.region(max_hold_s=0.2) as r:
        pass
    assert r.grant["max_hold_s"] == 0.2
    with krex.region() as r:  # no request: the ceiling
        pass
    assert r.grant["max_hold_s"] == 0.5



def test_a_grant_that_arrived_late_leaves_less_of_the_ceiling():
    """The daemon counts the hold from when it sent the grant; a loaded run revoked a
    measurement that stopped by its own clock, started only when the grant arrived."""
    from types import SimpleNamespace

    from krex.measure.loop import HOLD_SLACK_S, granted_ceiling_s

    now = time.monotonic()
    late = SimpleNamespace(grant={"max_hold_s": 0.5, "granted_mono_s": now - 0.2})
    on_time = SimpleNamespace(grant={"max_hold_s": 0.5, "granted_mono_s": now})
    assert granted_ceiling_s(on_time) == pytest.approx(0.5 - HOLD_SLACK_S, abs=0.02)
    assert granted_ceiling_s(late) == pytest.approx(0.5 - HOLD_SLACK_S - 0.2, abs=0.02)
    assert granted_ceiling_s(SimpleNamespace(grant={"max_hold_s": None})) == float("inf")
