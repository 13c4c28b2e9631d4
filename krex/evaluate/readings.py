"""The one place ``krex.evaluate`` reads ``krex.measure``'s results.

A :class:`~krex.measure.result.Comparison` and its region report are read
here only, into plain dicts (the report in its serialised form,
docs/protocol.md), so a change of their shape is a change of this module.
"""

from __future__ import annotations

from typing import Any

from krex.protocol.report import RegionReport


def report_dict(report: RegionReport | None) -> dict[str, Any]:
    """A region report in its serialised form (``{}`` when there is none)."""
    return {} if report is None else report.to_dict()


def comparison(c: Any) -> dict[str, Any]:
    """What an evaluation keeps of a comparison: verdict, interval, summaries, samples, warnings."""
    warnings = [{"warning": w.name, "detail": c.warning_details.get(w.name, ""),
                 "next_action": w.next_action} for w in c.warnings]
    return {
        "verdict": c.verdict, "speedup": c.speedup, "ci_low": c.ci_low, "ci_high": c.ci_high,
        "confidence": c.confidence, "same_within": c.same_within, "pairs": c.pairs,
        "order": c.order, "stop_reason": c.stop_reason, "timer": c.timer,
        "elapsed_s": c.elapsed_s, "attempts": c.attempts,
        "screened": c.screened, "discarded_pairs": c.discarded_pairs,
        "reference": dict(c.baseline), "candidate": dict(c.candidate),
        "reference_samples_ms": list(c.baseline_samples_ms),
        "candidate_samples_ms": list(c.candidate_samples_ms),
        "warnings": warnings,
        "region": report_dict(c.region),
        "rejected_regions": [report_dict(r) for r in c.rejected_regions],
    }
