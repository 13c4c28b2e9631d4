"""Timing krex itself distrusts gives no speed verdict (issue 13, verdict honesty).

A plain busy loop that krex does not manage, pinned on the core the daemon reserves
for region holders (the suite runs with the shield off, so nothing moves it away),
takes half of the holder's core in every region: each region's report says the
holder was preempted and names the loop, compare measures the pairs again in a new
region (its retry), and when that one is disturbed too the evaluation is
``unclear`` with ``TIMING_UNTRUSTED`` -- not ``faster``, although the interval of
the disturbed samples alone would say so.  The control is the same evaluation with
no loop beside it: the speed verdict.
"""

from __future__ import annotations

import os
import subprocess

import psutil
import pytest
from evaluate_helpers import CPU, abstained_for_contention, module_daemon, spec
from helpers import PY, reap, wait_for

import krex
from krex.enforce.isolation import default_cores
from krex.evaluate import judge

pytestmark = pytest.mark.slow

REF, INPUTS = spec(CPU, "kernels.py:reference"), spec(CPU, "inputs.py:make")
HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile 1: pass"
SPEED_VERDICTS = {"faster", "slower", "same"}


@pytest.fixture(scope="module")
def daemon_m(tmp_path_factory):
    yield from module_daemon(tmp_path_factory)


def _evaluate():
    return krex.evaluate(REF, spec(CPU, "honest.py:faster"), INPUTS, cache="hot", fresh=True,
                         save=False)


def _reserved_core() -> int:
    cores = default_cores(sorted(os.sched_getaffinity(0)))
    if not cores:
        pytest.skip("a single-core machine reserves no core")
    return cores[-1]


def test_a_hog_on_the_holders_core_makes_the_verdict_unclear_not_faster(daemon_m):
    hog = subprocess.Popen([PY, "-c", HOG, str(_reserved_core())])
    try:
        wait_for(lambda: psutil.Process(hog.pid).cpu_times().user > 0.05, 10)
        runs = [_evaluate() for _ in range(3)]
    finally:
        reap(hog)
    for ev in runs:
        assert ev.verdict not in SPEED_VERDICTS, ev.summary()
        assert ev.verdict == "unclear" and ev.correct and "TIMING_UNTRUSTED" in ev.codes(), \
            ev.summary()
        found = next(f for f in ev.findings if f.code.name == "TIMING_UNTRUSTED")
        assert "holder_preempted" in found.evidence["disturbed_by"], found.evidence
        assert ev.timing["attempts"] == 2 and len(ev.timing["rejected_regions"]) == 1  # retried
        assert abstained_for_contention(ev)
    # the disturbed samples alone would have claimed a speed (what the old judge said)
    raw = [judge.timing_verdict(ev.timing, 0.03) for ev in runs]
    assert "faster" in raw, [ev.summary() for ev in runs]


def test_control_the_same_evaluation_without_the_hog_gets_the_speed_verdict(daemon_m):
    """Other sessions' processes on this shared machine may still take the holder's core
    (shield off): then the run abstains the same way; one of three must answer."""
    runs = []
    for _ in range(3):
        ev = _evaluate()
        runs.append(ev)
        if ev.verdict == "faster":
            break
        assert abstained_for_contention(ev), ev.summary()
    assert runs[-1].verdict == "faster" and runs[-1].ok, [ev.summary() for ev in runs]
    assert "TIMING_UNTRUSTED" not in runs[-1].codes()
