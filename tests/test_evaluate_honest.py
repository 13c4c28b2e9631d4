"""No false alarms: honest candidates get the right verdict and no integrity finding.

40 evaluations each of a correct faster (true 2x), a correct same-speed
(identical code) and a correct slower (true 0.5x) candidate on ``cpu``,
through one daemon, interleaved so that the machine's drift hits all three
alike.  At least 90 % of each must be right and clean.  An ``unclear``
verdict that says why (``TIMING_UNTRUSTED``: its regions were not clean, the
machine's own load; ``TIMING_SCREENED``: other tasks took the holder's core, the
pairs they hit were set aside and the rest did not fit the band within the budget)
is an abstention, not an answer: it is left out of the 90 %, but at most a quarter
of the runs may abstain (a CPU loop beside the suite: 4 of 40 same-speed runs once
did; 5 of 40, screened, at c2940b3).  The
timing uses ``cache="hot"`` to keep the test affordable: a cold-cache sample
on this machine costs a 210 MiB flush (~25 ms), and "same" needs ~300 pairs
to fit its interval in the ±4 % band (docs/evaluate.md).  The negative
control is test_evaluate.py: the same pipeline finds every hack.
"""

from __future__ import annotations

import collections

import pytest
from evaluate_helpers import CPU, spec

import krex

pytestmark = [pytest.mark.slow,
              pytest.mark.timeout(900)]  # 120 evaluations; a sealed one (cpu's default)
# starts two interpreters (~0.5-1.3 s here under load): over the suite's 300 s

RUNS = 40
SHARE = 0.9  # of the runs that gave an answer: 39-40 of 40 alone here; 37 of 40 in CI once
# (2026-12-07, 3 identical-code runs read `faster` 1.04-1.05x within 5 s: a burst of bias
# that each run's interval does not carry -- docs/evaluate.md, Limits)
ABSTAIN_AT_MOST = RUNS // 4
CANDIDATES = {"honest.py:faster": "faster", "honest.py:same": "same",
              "honest.py:slower": "slower"}
# findings an honest candidate may carry: notes, and the machine's own timing caveats
ALLOWED = {"NO_HELD_OUT_SHAPE", "NOT_BITWISE_DETERMINISTIC", "TIMING_UNTRUSTED",
           "TIMING_SCREENED"}


def test_honest_candidates_get_the_right_verdict_without_false_alarms(daemon_m):
    right: collections.Counter[str] = collections.Counter()
    abstained: collections.Counter[str] = collections.Counter()
    wrong: dict[str, list[str]] = collections.defaultdict(list)
    for _ in range(RUNS):
        for cand, expected in CANDIDATES.items():
            # The one-program evaluation: the sealed one (cpu's default) does not yet meet
            # a 95 % bar.  With its loop on one CPU it read 39/40 same-speed runs right alone
            # on a quiet machine, but 32/39 in a fresh clone's serial phase (6 'unclear'
            # with no code: intervals too wide within the budget) -- issue 42's open
            # part, measured by benchmarks/bench_sealed.py (docs/evaluate.md, Limits).
            ev = krex.evaluate(spec(CPU, "kernels.py:reference"), spec(CPU, cand),
                               spec(CPU, "inputs.py:make"), cache="hot", fresh=True, save=False,
                               isolation="worker")
            alarms = [c for c in ev.codes() if c not in ALLOWED]
            if ev.verdict == expected and ev.correct and not alarms:
                right[cand] += 1
            elif (ev.verdict == "unclear" and ev.correct and not alarms
                  and {"TIMING_UNTRUSTED", "TIMING_SCREENED"} & set(ev.codes())):
                abstained[cand] += 1
            else:
                wrong[cand].append(ev.summary())
    for cand in CANDIDATES:
        answered = RUNS - abstained[cand]
        assert abstained[cand] <= ABSTAIN_AT_MOST and right[cand] >= SHARE * answered, (
            f"{cand}: {right[cand]}/{answered} answers right, {abstained[cand]} unclear "
            f"for untrusted timing; {wrong[cand][:5]}")
