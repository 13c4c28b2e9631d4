"""benchmarks/trace_handoff.py cuts a plain handoff at the kernel's marks.

The fixtures are real handoffs from ftraces of held runs (docs/notes/handoff.md, "the
handoff's floor"): the outgoing job's region, its release, the daemon's moves, the
next job's thaw, then its ask and its grant (before offers), or its claim of the
daemon's offer and its region.  The figures the docs quote come from this parser;
these tests show it finds each handoff, in order, and none when a mark is missing.
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


def _trace(name: str = "handoff_trace.txt") -> str:
    with open(os.path.join(HERE, "data", name)) as f:
        return f.read()


def test_a_plain_handoff_is_cut_at_its_marks_in_order() -> None:
    th = _module()
    rows = th.handoffs(_trace(), DAEMON, JOBS)
    assert len(rows) == 1
    marks = [rows[0][m] for m in th.MARKS + th.ASKED]
    assert marks == sorted(marks) and marks[0] > 0
    # the release sent at 76591.879749, the next job's grant read at 76591.880738
    assert abs(rows[0]["grant_read"] - 989) < 1.5, rows[0]
    assert rows[0]["region_start"] == rows[0]["grant_read"] and rows[0]["offered"] == 0.0


def test_no_handoff_without_the_next_jobs_ask_or_without_the_daemon() -> None:
    th = _module()
    text = _trace()
    rows = th.handoffs(text, DAEMON, JOBS)
    nxt_ask = next(line for line in text.splitlines() if "sys_sendto" in line and
                   "76591.880" in line and any(f"-{j} " in line for j in JOBS))
    assert th.handoffs(text.replace(nxt_ask + "\n", ""), DAEMON, JOBS) == []
    assert th.handoffs(text, set(), JOBS) == []
    assert len(rows) == 1  # the control: the same text, whole, has its handoff


OFFERED_DAEMON = {10096, 10097, 10104, 10105, 10107, 10108, 10109, 10110, 10111}
OFFERED_JOBS = {10100, 10101, 10102, 10103}


def test_a_handoff_whose_next_job_claims_its_offer_starts_at_the_claim() -> None:
    """The next job (10102) reads its release's reply and the offer, sends its claim and
    reads nothing more until its own release, 5 ms on: its region began at the claim."""
    th = _module()
    rows = th.handoffs(_trace("handoff_trace_offered.txt"), OFFERED_DAEMON, OFFERED_JOBS)
    assert len(rows) == 1 and rows[0]["offered"] == 1.0
    marks = [rows[0][m] for m in th.MARKS]
    assert marks == sorted(marks) and marks[0] > 0
    assert rows[0]["region_start"] == rows[0]["ask_sent"]
    assert abs(rows[0]["region_start"] - 617) < 1.5, rows[0]
    assert not set(th.ASKED) & set(rows[0])


def test_an_offered_handoff_is_not_counted_without_the_next_jobs_later_call() -> None:
    """Control: cut before the next job's release, the trace cannot tell a claimed
    region from an ask still waiting for its grant: no handoff."""
    th = _module()
    lines = _trace("handoff_trace_offered.txt").splitlines()
    assert "python-10102" in lines[-1]  # its release's sendto, 5 ms after its claim
    cut = "\n".join(lines[:-1]) + "\n"
    assert th.handoffs(cut, OFFERED_DAEMON, OFFERED_JOBS) == []
