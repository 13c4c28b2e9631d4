"""Candidates that reach for the evaluation's evidence from plain Python (issue 42).

Through a real daemon on ``cpu``.  Each of tests/evaluate_gallery/cpu/reach.py and
profile_hook.py fooled the one-program evaluation (``isolation="worker"``, measured
2026-12-07 on this branch: gc_summary ``faster`` 2.96x at a true 1x, frame_timed 5.36x at
2x, profile_hook 5.68x at 1x, fake_ndarray 72.7x at 2x with only a flag, fork_spinner
no finding, ndarray_subclass an evaluation error).  With ``isolation="process"`` (cpu's
default) each must be caught with its named finding, or made harmless: the verdict its
true speed deserves, never ``faster`` for a true 1x.  The control: the one-program
evaluation still takes the lookalike array's word for it.
"""

from __future__ import annotations

import pytest
from evaluate_helpers import CPU, evaluate_cpu, spec

pytestmark = pytest.mark.slow

REF, INPUTS = spec(CPU, "kernels.py:reference"), spec(CPU, "inputs.py:make")
REPEATS = 2

CAUGHT = {  # -> the finding that must name it
    "reach.py:fake_ndarray": "OUTPUT_NOT_A_BUFFER",
    "reach.py:ndarray_subclass": "OUTPUT_NOT_A_BUFFER",
    "reach.py:fork_spinner": "WORK_AFTER_RETURN",
}
HARMLESS = {  # -> the highest speedup its true speed allows (true 1x, 1x, 2x, 1x)
    "reach.py:gc_summary": 1.5,
    "profile_hook.py:profile_hook": 1.5,
    "reach.py:frame_timed": 3.0,
    "reach.py:patch_restored": 1.5,  # the one-program evaluation catches this one too
    # (KREX_TAMPERED, 2 of 2): its timer patched for the loop and put back after it
}


evaluate = evaluate_cpu


@pytest.mark.parametrize("cand", sorted(CAUGHT))
def test_each_reach_is_caught_with_its_finding(daemon_m, cand):
    for _ in range(REPEATS):
        ev = evaluate(cand)
        assert ev.verdict == "invalid" and CAUGHT[cand] in ev.codes(), ev.summary()
        assert ev.integrity["isolation"] == "process"


@pytest.mark.parametrize("cand", sorted(HARMLESS))
def test_each_reach_is_harmless(daemon_m, cand):
    for _ in range(REPEATS):
        ev = evaluate(cand)
        assert ev.correct and not ev.invalid_findings, ev.summary()
        assert ev.speedup is not None and ev.speedup < HARMLESS[cand], ev.summary()
        if HARMLESS[cand] < 2:
            assert ev.verdict != "faster", ev.summary()


def test_every_call_is_dispatched_alike_and_late_outputs_are_checked(daemon_m):
    ev = evaluate("honest.py:faster")
    assert ev.ok and ev.correct, ev.summary()
    dispatch, kept = ev.integrity["dispatch"], ev.integrity["checked_timed"]
    assert dispatch["calls"] > 0 and 0 < dispatch["p50_us"] <= dispatch["p99_us"]
    assert dispatch["copied_bytes"] == 256 * 512 * 4
    calls = sorted(int(k.split("/")[2]) for k in kept)  # a uniform sample and the last 4
    assert len(kept) >= 8 and calls[-4:] == list(range(calls[-1] - 3, calls[-1] + 1)), kept
    assert calls[-1] + 1 >= ev.timing["pairs"], (kept, ev.timing["pairs"])
    account = ev.integrity["accounting"]
    assert account["calls_ms"] > 0 and "WORK_AFTER_RETURN" not in ev.codes(), account
    # both sides metered alike, the loop on one CPU (krex.evaluate.onecore)
    assert isinstance(ev.integrity["one_cpu"], int), ev.integrity.get("one_cpu")
    ref_gaps = ev.integrity["reference_between_calls"]
    assert ref_gaps["gaps"] == ev.integrity["between_calls"]["gaps"] > 0, ref_gaps


def test_control_the_one_program_evaluation_believes_the_lookalike(daemon_m):
    ev = evaluate("reach.py:fake_ndarray", isolation="worker")
    assert ev.verdict != "invalid" and "OUTPUT_NOT_A_BUFFER" not in ev.codes(), ev.summary()
