"""Timing krex itself distrusts gives no speed verdict (issue 13, verdict honesty).

A plain busy loop that krex does not manage, pinned on the core the daemon reserves
for region holders (the suite runs with the shield off, so nothing moves it away),
shares the holder's core in every region: each region's report says the holder was
preempted.  compare sets aside every A/B pair with a sample in which the timing
thread waited for its CPU (its run delay; ``screen_offcpu``) and samples on within
its budget:

- with calls longer than the loop's scheduler slices (1024 x 1024 here: every sample
  is preempted) no pair is left undisturbed, compare measures again in a new region
  (its retry), and the evaluation is ``unclear`` with ``TIMING_UNTRUSTED`` -- not the
  ``faster`` the disturbed samples' interval alone says.  The control is the same
  evaluation with no loop beside it: ``faster``.
- with short calls most pairs run between the loop's slices: the verdict comes from
  those alone (no TIMING_UNTRUSTED).
- on ``fakegpu`` (a device timer) nothing is screened: a disturbed region is retried
  and, still disturbed, ``unclear``.  Never a speed verdict *with* TIMING_UNTRUSTED.
"""

from __future__ import annotations

import contextlib
import os
import subprocess

import psutil
import pytest
from evaluate_helpers import CPU, FAKEGPU, abstained_for_contention, spec
from helpers import PY, reap, wait_for

import krex
from krex.enforce.isolation import default_cores
from krex.evaluate import judge

pytestmark = pytest.mark.slow

HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile 1: pass"
SPEED_VERDICTS = {"faster", "slower", "same"}
LONG = [[4096, 2048], [96, 200]]  # calls of 6 and 12 ms: longer than a scheduler slice


def _evaluate(device: str = "cpu", **kw):
    folder = FAKEGPU if device.startswith("fakegpu") else CPU
    cand = "kernels.py:faster" if folder == FAKEGPU else "honest.py:faster"
    return krex.evaluate(spec(folder, "kernels.py:reference"), spec(folder, cand),
                         spec(folder, "inputs.py:make"), device=device, cache="hot",
                         fresh=True, save=False, **kw)


@contextlib.contextmanager
def _hog_on_the_holders_core():
    cores = default_cores(sorted(os.sched_getaffinity(0)))
    if not cores:
        pytest.skip("a single-core machine reserves no core")
    hog = subprocess.Popen([PY, "-c", HOG, str(cores[-1])])
    try:
        wait_for(lambda: psutil.Process(hog.pid).cpu_times().user > 0.05, 10)
        yield hog
    finally:
        reap(hog)


def _untrusted(ev):
    return next((f for f in ev.findings if f.code.name == "TIMING_UNTRUSTED"), None)


def test_long_calls_beside_a_hog_on_the_holders_core_are_unclear_not_faster(daemon_m):
    """Every run either abstains (``unclear``, TIMING_UNTRUSTED for the holder's
    preemption) or answers from pairs the loop left alone (a CPU loop beside the suite
    changes the scheduler's slices, and a few pairs then fit between them: once a run
    said ``faster``, rightly, from those).  Up to 4 runs, until one abstains where the
    disturbed samples alone would have claimed ``faster``."""
    def shown(ev) -> bool:  # abstained, where the disturbed samples alone claimed a speed
        return ev.verdict == "unclear" and judge.timing_verdict(ev.timing, 0.03) == "faster"

    runs = []
    with _hog_on_the_holders_core():
        while len(runs) < 4 and not any(shown(ev) for ev in runs):
            runs.append(_evaluate(shapes=LONG))
    for ev in runs:
        found, t = _untrusted(ev), ev.timing
        if ev.verdict != "unclear":  # from undisturbed pairs only, never with untrusted timing
            assert ev.verdict == "faster" and ev.correct and found is None, ev.summary()
            assert t["screened"] and t["discarded_pairs"] > 0, ev.summary()
            continue
        assert ev.correct and found is not None, ev.summary()
        assert "holder_preempted" in found.evidence["disturbed_by"], found.evidence
        assert t["attempts"] == 2 and len(t["rejected_regions"]) == 1
        assert abstained_for_contention(ev)
    # the disturbed samples alone would have claimed a speed (what the old judge said)
    assert shown(runs[-1]), [ev.summary() for ev in runs]


def test_control_the_same_evaluation_without_the_hog_is_faster(daemon_m):
    """Other sessions' processes on this shared machine may still take the holder's core
    (shield off; a CPU loop beside the suite does): then a run abstains the same way,
    rightly, and when all three do the control cannot be shown here (xfail)."""
    runs = []
    for _ in range(3):
        runs.append(_evaluate(shapes=LONG))
        if runs[-1].verdict == "faster":
            break
        assert abstained_for_contention(runs[-1]), runs[-1].summary()
    else:
        pytest.xfail("the machine's own load took the holder's core in every region: "
                     + "; ".join(ev.summary() for ev in runs))
    assert runs[-1].ok, [ev.summary() for ev in runs]
    assert _untrusted(runs[-1]) is None


def test_short_calls_beside_a_hog_answer_from_the_undisturbed_pairs_only(daemon_m):
    """Short calls: a run's pairs may all fit inside the holder's scheduler slices (a
    CI run beside a CPU loop once saw no pair disturbed in 2 runs), so up to 6 runs,
    until the loop was in the way of one -- each must answer from undisturbed pairs
    only, or abstain."""
    runs = []
    with _hog_on_the_holders_core():
        while len(runs) < 6 and not any(ev.timing["discarded_pairs"] for ev in runs):
            runs.append(_evaluate())
    print("discarded pairs per run:", [ev.timing["discarded_pairs"] for ev in runs])
    for ev in runs:
        t = ev.timing
        assert t["screened"], ev.summary()
        found = _untrusted(ev)
        if ev.verdict in SPEED_VERDICTS:  # from undisturbed pairs only
            assert ev.verdict == "faster" and found is None, ev.summary()
            assert t["discarded_pairs"] <= t["pairs"]
        else:
            assert ev.verdict == "unclear", ev.summary()
    assert sum(ev.timing["discarded_pairs"] for ev in runs) > 0  # the loop was in the way


def test_fakegpu_is_not_screened_a_hog_gives_no_speed_verdict_with_untrusted_timing(daemon_m):
    """A device timer's samples are not screened by the holder's wait (the fake device's
    kernels run in a server on the other cores, disturbed where the holder's wait does
    not show): a region the hog disturbed is retried, and still disturbed is
    ``unclear``."""
    fakegpu = pytest.importorskip("krex.devices.fakegpu")
    if not fakegpu.available():
        pytest.skip("fakegpu was not built")
    runs, seen = [], 0
    with _hog_on_the_holders_core():
        # Until the hog was seen in the way (2 runs usually; beside other load the
        # scheduler sometimes keeps it off the holder's timed stretches for longer).
        while len(runs) < 4 and (len(runs) < 2 or not seen):
            ev = _evaluate("fakegpu:0")
            runs.append(ev)
            t = ev.timing
            assert not t["screened"] and t["discarded_pairs"] == 0, ev.summary()
            found = _untrusted(ev)
            assert not (ev.verdict in SPEED_VERDICTS and found is not None), ev.summary()
            assert ev.verdict in ("faster", "unclear"), ev.summary()
            reports = [t["region"], *t["rejected_regions"]]
            seen += sum("holder_preempted" in {r["code"] for r in rep.get("reasons", [])}
                        for rep in reports)
    if not seen:  # each run's claims held, but none was put to the test
        pytest.skip("the hog never preempted the holder in 4 evaluations (other load on "
                    f"this machine kept it away): {[ev.summary() for ev in runs]}")
