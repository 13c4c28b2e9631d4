"""benchmarks/trace_handoff.py cuts a plain handoff at the kernel's marks.

The fixture is one real handoff from an ftrace of a held run (2026-12-04; docs/
benchmarks.md, "the handoff's floor"): the outgoing job's region, its release, the
daemon's moves, the next job's thaw, its ask and its grant.  The figures the docs
quote come from this parser; these tests show it finds the handoff, in order, and
finds none when a mark is missing.
"""

from __future__ import annotations

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DAEMON = {14032, 14033, 14035, 14040, 14041, 14043, 14044, 14045, 14046, 14047}
JOBS = {14036, 14037, 14038, 14039}


def _module():
    path = os.path.join(os.path.dirname(HERE), "benchmarks", "trace_handoff.py")
    spec = importlib.util.spec_from_file_location("trace_handoff", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace() -> str:
    with open(os.path.join(HERE, "data", "handoff_trace.txt")) as f:
        return f.read()


def test_a_plain_handoff_is_cut_at_its_marks_in_order() -> None:
    th = _module()
    rows = th.handoffs(_trace(), DAEMON, JOBS)
    assert len(rows) == 1
    marks = [rows[0][m] for m in th.MARKS]
    assert marks == sorted(marks) and marks[0] > 0
    # the release sent at 76591.879749, the next job's grant read at 76591.880738
    assert abs(rows[0]["grant_read"] - 989) < 1.5, rows[0]


def test_no_handoff_without_the_next_jobs_ask_or_without_the_daemon() -> None:
    th = _module()
    text = _trace()
    rows = th.handoffs(text, DAEMON, JOBS)
    nxt_ask = next(line for line in text.splitlines() if "sys_sendto" in line and
                   "76591.880" in line and any(f"-{j} " in line for j in JOBS))
    assert th.handoffs(text.replace(nxt_ask + "\n", ""), DAEMON, JOBS) == []
    assert th.handoffs(text, set(), JOBS) == []
    assert len(rows) == 1  # the control: the same text, whole, has its handoff
