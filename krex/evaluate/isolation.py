"""Judging the evidence of a sealed evaluation (``isolation="process"``).

Pure rules over what the trusted driver measured (:mod:`krex.evaluate.sealed`): an
output its dispatcher refused, and the candidate's CPU time beyond its dispatcher's
thread as the kernel counted it (its cgroup: threads, forks, double forks).
"""

from __future__ import annotations

from typing import Any

from krex.evaluate.findings import Code, Finding

OUTSIDE_SLACK_MS = 10.0  # scheduler-tick granularity of other tasks' CPU time
OUTSIDE_PER_HELPER = 1.1  # a thread or process the candidate started may run while its
# calls run: at most this share of the calls' time each ...
BETWEEN_SLACK_MS = 10.0  # ... but between its timed calls (read at every call boundary,
# krex's own threads' after-work taken out) hardly at all


def findings(summary: dict[str, Any]) -> list[Finding]:
    out = []
    bad = summary.get("bad_output")
    if bad and bad.get("role") == "candidate":
        out.append(Finding(Code.OUTPUT_NOT_A_BUFFER, f"in stage {bad.get('stage')}: the "
                           f"output is a {bad.get('type')}", dict(bad)))
    account = summary.get("accounting")
    if account:
        out += _outside(account, summary.get("between_calls") or {})
    return out


def _outside(a: dict[str, Any], between: dict[str, Any]) -> list[Finding]:
    """CPU time the candidate's own threads and processes used beyond its calls' span
    over the whole evaluation, or between its timed calls at all (the reference's calls
    and the driver's work: where a helper that runs only while the calls run never is)."""
    helpers = int(a.get("threads_started") or 0) + max(0, int(a.get("processes") or 1) - 1)
    allowed = helpers * float(a.get("calls_ms") or 0.0) * OUTSIDE_PER_HELPER + OUTSIDE_SLACK_MS
    outside = float(a.get("cpu_outside_ms") or 0.0)
    gaps_ms = float(between.get("cpu_ms") or 0.0)
    if outside <= allowed and gaps_ms <= BETWEEN_SLACK_MS:
        return []
    evidence = {"cpu_outside_ms": round(outside, 3), "cpu_outside_allowed_ms": round(allowed, 3),
                "cpu_between_timed_calls_ms": round(gaps_ms, 3),
                "cpu_between_allowed_ms": BETWEEN_SLACK_MS,
                "threads_started": a.get("threads_started"), "processes": a.get("processes"),
                "calls_ms": round(float(a.get("calls_ms") or 0.0), 3)}
    what = ", ".join(f"{k}={v}" for k, v in evidence.items())
    return [Finding(Code.WORK_AFTER_RETURN, f"the kernel counted CPU time of the candidate's "
                    f"threads and processes beyond its calls: {what}", evidence)]


def candidate_error(summary: dict[str, Any]) -> bool:
    """Whether a failed program is a CANDIDATE_ERROR (not an output refused by name)."""
    bad = summary.get("bad_output")
    return not (bad and bad.get("role") == "candidate")
