"""Fairness when freezing replaces queueing, through a real daemon and real timers.

Jobs take back-to-back regions (tests/jobs/back_to_back.py: busy inside the
region, then busy outside it).  A job frozen by another's region cannot ask
for the next one, so without the fair window a job that asks again the
instant it releases is granted again and again.  Shares are counted from the
jobs' own region counts and clocks; each test has a negative control that
shows the check turning false without the mechanism.  Run under the suite
lock: the margins come from runs on the shared 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from helpers import PY, Daemon, reap

JOB = os.path.join(os.path.dirname(__file__), "jobs", "back_to_back.py")
SECONDS = 3.0


def run(d: Daemon, jobs: list[tuple[float, str | None]], hold_ms: float = 5.0) -> list[dict]:
    """Start one back-to-back job per (gap_ms, tenant) at once; their results."""
    start = time.monotonic() + 2.0  # every job connected and warmed up by then
    procs = []
    try:
        for gap_ms, tenant in jobs:
            env = {**os.environ, "KREX_SOCKET": d.socket}
            if tenant is not None:
                env["KREX_TENANT"] = tenant
            procs.append(subprocess.Popen(
                [PY, JOB, str(start), str(SECONDS), str(hold_ms), str(gap_ms)],
                stdout=subprocess.PIPE, text=True, env=env))
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        return [json.loads(o) for o in outs]
    finally:
        for p in procs:
            reap(p)


def spread(values: list[float]) -> float:
    """The largest relative distance from the mean."""
    mean = sum(values) / len(values)
    return max(abs(v - mean) for v in values) / mean


@pytest.mark.slow
def test_back_to_back_jobs_get_equal_shares(tmp_path):
    """One job asks again at once, three need 30 ms of work between regions: with a
    fair window longer than that (50 ms) every job's region count is within ±20 % of
    the mean; with the window off (--fair-window-ms 0, the negative control) the
    greedy job takes clearly more (measured 1.4-1.5x the others)."""
    jobs = [(0.0, None), (30.0, None), (30.0, None), (30.0, None)]
    shares = {}
    for window in ("50", "0"):
        rt = tmp_path / f"w{window}"
        rt.mkdir(mode=0o700)
        d = Daemon(str(rt), "--fair-window-ms", window).start()
        try:
            shares[window] = [r["regions"] for r in run(d, jobs)]
        finally:
            d.stop()
    fair, unfair = shares["50"], shares["0"]
    # The premise: a region's whole cycle (grant, hold, release, enforcement) is well
    # under the others' 30 ms gap, so they are still busy when the greedy job asks again.
    # As the cycle nears the gap, every job is queued at every release and plain FIFO
    # is round-robin: neither the claim nor its control can show anything.  Measured
    # on the loaded machine (cycle ms: greedy/others without the window): 13.8: 1.6,
    # 21.0: 1.29, 21.3: 1.45, 23.1: 1.19, 25.2: 1.06, and 54: 1.0 in a loaded suite run.
    # So the control needs cycles under 20 ms (2/3 of the gap).
    cycle_ms = SECONDS * 1e3 / sum(unfair)
    if cycle_ms >= 20.0:
        pytest.skip(f"the machine is too loaded: {cycle_ms:.0f} ms per region cycle, not "
                    f"under the 20 ms this test needs ({shares})")
    assert spread(fair) <= 0.20, shares
    greedy, others = unfair[0], sum(unfair[1:]) / 3
    assert greedy > 1.2 * others, shares  # the control: without the window it is unfair


@pytest.mark.slow
def test_tenants_share_a_device_not_their_jobs(tmp_path):
    """Tenant A runs 1 job, tenant B 6, all back to back: A and B hold the device
    within ±20 % of equal time.  Control: the same jobs under one tenant (the uid)
    give A's job about a seventh."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    d = Daemon(str(rt)).start()
    try:
        tenants = ["A"] + ["B"] * 6
        results = run(d, [(0.0, t) for t in tenants])
        a = results[0]["held_s"]
        b = sum(r["held_s"] for r in results[1:])
        control = run(d, [(0.0, None)] * 7)
    finally:
        d.stop()
    assert spread([a, b]) <= 0.20, (a, b)
    alone = control[0]["held_s"]
    rest = sum(r["held_s"] for r in control[1:])
    assert spread([alone, rest]) > 0.5, (alone, rest)  # the control: one job's share
