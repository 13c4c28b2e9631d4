"""`krex doctor`'s measured check: what a cgroup move costs after a quiet spell.

The kernel state it reports (whether a move waits for an RCU grace period) is
machine-wide and, from Linux 6.18, cannot be turned back once ``favordynmods``
was set, so no test changes it: the real probe is run as the machine is, with
an in-run control (back-to-back moves never wait), and the verdict is checked
on both sides with the figures measured on this machine in each state.
"""

from __future__ import annotations

import os

import pytest

from krex.enforce.cgroups import CgroupLayout
from krex.enforce.doctor import (
    GRACE_PERIOD_MS,
    _moves_check,
    _scratch_base,
    _warmer,
    move_cost,
    move_verdict,
)


def _writable_layout() -> CgroupLayout:
    layout = CgroupLayout.probe()
    if _scratch_base(layout)[1] is None:
        pytest.skip("no writable cgroup here (needs root): moves cannot be measured")
    return layout


def _scratch_dirs(layout: CgroupLayout) -> list[str]:
    base = _scratch_base(layout)[1]
    assert base is not None
    return [n for n in os.listdir(base) if n.startswith("krex-doctor")]


def test_a_move_after_a_quiet_spell_is_measured_and_nothing_is_left():
    layout = _writable_layout()
    cost = move_cost(layout, quiet_s=0.06, n=3)
    assert cost["after_quiet_ms"] > 0 and cost["back_to_back_ms"] > 0, cost
    # the verdict follows the measurement, whichever state the kernel is in
    assert cost["waits"] is (cost["after_quiet_ms"] > GRACE_PERIOD_MS), cost
    assert cost["ok"] is True, cost  # it does not wait, or the daemon keeps moves warm
    if cost["favordynmods"]:
        assert cost["ok"], f"favordynmods is on, yet a move waited: {cost}"
    assert _scratch_dirs(layout) == []


def test_back_to_back_moves_are_not_reported_as_waiting():
    """In-run control: with no quiet before them, moves find the rwsem just used and
    never wait for a grace period, in either kernel state, so the check passes; a check
    that always failed would fail here."""
    layout = _writable_layout()
    cost = move_cost(layout, quiet_s=0.0, n=5)
    assert cost["ok"] is True and cost["waits"] is False, cost
    assert cost["after_quiet_ms"] < GRACE_PERIOD_MS, cost


def test_the_verdict_turns_on_a_grace_period_and_says_what_to_do():
    # measured here (docs/notes/handoff.md): 5.8 ms after 50 ms of quiet on a stock kernel,
    # 0.13-0.23 ms with the per-threadgroup rwsem that favordynmods enables
    waited = move_verdict(5.8, favordynmods_on=False, warmed=False)
    assert waited["ok"] is False and "grace period" in waited["why"]
    warmed = move_verdict(5.8, favordynmods_on=False)  # the daemon's default: warm pings
    assert warmed["ok"] is True and warmed["waits"] is True
    assert "--warm-moves-ms, 4 by default" in warmed["why"]
    assert "--warm-linger-s (30 s by default)" in warmed["why"]
    # which daemon: none runs (the defaults would warm), one that warms, one that does not
    assert _warmer(None) == (True, "a daemon started with the defaults (none runs now)")
    running = {"pid": 7, "warm_moves": {"state": "idle", "why": ""}}
    assert move_verdict(5.8, False, *_warmer(running))["ok"] is True
    assert "the running daemon (pid 7) keeps" in move_verdict(5.8, False, *_warmer(running))["why"]
    off = {"pid": 7, "warm_moves": {"state": "off",
                                    "why": "disabled by configuration (--warm-moves-ms 0)"}}
    cold = move_verdict(5.8, False, *_warmer(off))
    assert cold["ok"] is False and "(pid 7) does not keep them warm: disabled" in cold["why"]
    assert move_verdict(0.23, favordynmods_on=True) == {"ok": True, "waits": False, "why": ""}
    assert "loaded machine" in move_verdict(5.8, favordynmods_on=True)["why"]
    check = _moves_check({"ok": False, "favordynmods": False, "quiet_ms": 60.0,
                          "after_quiet_ms": 5.8, "back_to_back_ms": 0.03, "hierarchy": "v2",
                          "v2_root": "/sys/fs/cgroup", **waited})
    assert not check["ok"]
    assert check["advice"].startswith("let the daemon keep moves warm")
    assert "mount -o remount,favordynmods /sys/fs/cgroup " in check["advice"]
    assert "5.8 ms" in check["detail"] and "favordynmods off" in check["detail"]


def test_without_a_writable_cgroup_the_check_says_why():
    cost = move_cost(CgroupLayout.none("cgroups disabled for this test"))
    assert cost["ok"] is None and "needs root" in cost["why"]
    check = _moves_check(cost)
    assert check["ok"] and check["detail"].startswith("not measured")
