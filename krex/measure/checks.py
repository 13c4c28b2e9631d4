"""Warnings a measurement can carry, each with the next action to take.

Every check is a pure function from evidence (samples, the region report,
clocks, the stop reason) to a list of ``(MeasureWarning, detail)`` pairs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import Any

from krex.measure import clocks, stats, stopping
from krex.protocol.report import ReasonCode, RegionReport

Finding = tuple["MeasureWarning", str]

PLAUSIBILITY_SLACK_REL = 0.005  # clocks of timer and region differ a little
PLAUSIBILITY_SLACK_S = 0.001
# A sample should span >= 100 x the timer's resolution (its tick or the cost of an
# empty start/stop, whichever is larger): the timer then adds <= 1 % to a sample.
# CpuTimer: ~0.2 us here, so samples under ~20 us warn; CUDA events: 0.5 us -> 50 us.
TIMER_RESOLUTION_FACTOR = 100
# Cold-cache flushes "dominate" when they take more of the hold than the samples do.
FLUSH_DOMINATES_RATIO = 1.0


class MeasureWarning(Enum):
    """Why a number may not be trusted, and what to do about it."""

    UNSTABLE = (
        "the median is less certain than the noise target",
        "raise max_time_s for more samples; if the noise persists, check `krex status` "
        "for interference",
    )
    TOO_SHORT_FOR_TIMER = (
        "samples are too short for the timer's resolution",
        "time more work per call (loop inside fn) or use CUDA-graph timing",
    )
    THROTTLED = (
        "the device clocked down during the measurement",
        "cool down or lock clocks, then rerun; compare only runs at the same clocks",
    )
    REGION_NOT_CLEAN = (
        "the region report is not clean (interference or enforcement gaps)",
        "read the report's reasons and steps; rerun with more retries",
    )
    REGION_REVOKED = (
        "the region exceeded its maximum hold and was revoked",
        "raise max_hold_s or lower max_time_s / timeout_s",
    )
    PLAUSIBILITY_FAILED = (
        "timed samples do not fit in the region's hold time (or are negative / NaN)",
        "do not use this number; check that fn runs on the timed device and stream",
    )
    ENFORCEMENT_IMPOSSIBLE = (
        "exclusivity could not be enforced (no daemon or missing mechanisms)",
        "run `krex doctor`; start the daemon or run where gating/freezing is allowed",
    )

    def __init__(self, summary: str, next_action: str) -> None:
        self.summary = summary
        self.next_action = next_action


def plausibility(samples_ms: Sequence[float], held_s: float | None) -> list[Finding]:
    bad = [s for s in samples_ms if not math.isfinite(s) or s < 0]
    if bad:
        return [(MeasureWarning.PLAUSIBILITY_FAILED, f"{len(bad)} negative or non-finite samples")]
    if held_s is None:
        return []
    total_s = math.fsum(samples_ms) / 1e3
    if total_s > held_s * (1 + PLAUSIBILITY_SLACK_REL) + PLAUSIBILITY_SLACK_S:
        detail = f"samples sum to {total_s:.6f} s but the region was held {held_s:.6f} s"
        return [(MeasureWarning.PLAUSIBILITY_FAILED, detail)]
    return []


def timer_resolution(median_ms: float, resolution_ms: float) -> list[Finding]:
    floor_ms = TIMER_RESOLUTION_FACTOR * resolution_ms
    if median_ms < floor_ms:
        detail = f"median {median_ms:.6f} ms < {floor_ms:.6f} ms (100 x timer resolution)"
        return [(MeasureWarning.TOO_SHORT_FOR_TIMER, detail)]
    return []


def noise(stop_reason: str, samples_ms: Sequence[float], noise_rel: float,
          target_rel: float | None) -> list[Finding]:
    """UNSTABLE when sampling stopped unconverged and the median's 95 % interval is
    wider than ``±target_rel``: per-sample noise alone (a memory-bound kernel on a
    shared machine) is no reason to distrust a median known precisely."""
    if target_rel is None or stop_reason in stopping.QUIET_REASONS:
        return []
    uncertain = stats.median_uncertainty_rel(samples_ms)
    if noise_rel > target_rel and uncertain > target_rel:
        detail = (f"median ±{uncertain:.2%} (95 %) > target {target_rel:.2%}, noise "
                  f"{noise_rel:.2%} per sample over {len(samples_ms)} samples "
                  f"(stopped: {stop_reason})")
        return [(MeasureWarning.UNSTABLE, detail)]
    return []


def cost_hints(cache: str, flush_bytes: int | None, overhead_ms: float | None,
               median_ms: float) -> list[str]:
    """A one-line hint when cold-cache flushes take more of the hold than the samples."""
    if cache != "cold" or not overhead_ms or overhead_ms <= FLUSH_DOMINATES_RATIO * median_ms:
        return []
    share = overhead_ms / (overhead_ms + median_ms)
    size = f"{flush_bytes / 2**20:.0f} MiB " if flush_bytes else ""
    return [f"cold_cache: the {size}cache flush before each sample took {share:.0%} of the "
            f"timed loop ({overhead_ms:.2f} ms per sample, the call {median_ms:.3f} ms); pass "
            "cache='hot' for warm-cache timing (cpu: a smaller flush with "
            "timer=krex.measure.CpuTimer(flush_bytes=N))"]


def throttle(start: dict[str, Any], end: dict[str, Any], report: RegionReport) -> list[Finding]:
    """Throttling seen by our own clock samples, else by the region's device audit."""
    reason = clocks.throttle_reason(start, end)
    audit = report.device_audit
    if reason is None and audit is not None:
        seen = clocks.throttle_reason(audit.start, audit.end)
        reason = f"region report: {seen}" if seen else None
    return [(MeasureWarning.THROTTLED, reason)] if reason else []


def region(report: RegionReport) -> list[Finding]:
    """Warnings from the region report (a nested region: only its own evidence's reasons,
    the outer one judges the rest)."""
    if report.nested:
        return [(MeasureWarning.REGION_NOT_CLEAN, _why_not_clean(report))] if report.reasons else []
    out: list[Finding] = []
    gaps = report.gaps()
    if not report.enforced or gaps:
        whats = "; ".join(g.message for g in gaps)
        out.append((MeasureWarning.ENFORCEMENT_IMPOSSIBLE, whats or f"mode {report.mode}"))
    if report.revoked:
        revoked = report.reason(ReasonCode.REVOKED)
        why = revoked.message if revoked else f"held {report.held_s} s"
        out.append((MeasureWarning.REGION_REVOKED, why))
    if not report.clean and report.enforced:
        out.append((MeasureWarning.REGION_NOT_CLEAN, _why_not_clean(report)))
    return out


def _why_not_clean(report: RegionReport) -> str:
    gaps = report.gaps()
    if gaps:
        return "enforcement gaps: " + ", ".join(
            str(g.evidence.get("mechanism", g.code.value)) for g in gaps)
    return report.why_not_clean() or "the daemon saw interference (read the report's evidence)"


CONTENTION = frozenset({ReasonCode.HOLDER_PREEMPTED, ReasonCode.FOREIGN_TASK})


def only_contention(report: RegionReport) -> bool:
    """Released, and not clean only because other tasks took the holder's cores."""
    return (not report.revoked and bool(report.reasons)
            and all(r.code in CONTENTION for r in report.reasons))


def should_retry(report: RegionReport) -> bool:
    """Retry a revoked or not-clean region, unless its gaps are structural.

    A region that is not clean only because a mechanism is missing on this
    machine (a *gap* reason) would be just as unclean the next time.
    """
    if report.nested:
        return bool(report.reasons) and not report.gaps()  # its own holder was preempted
    if not report.enforced:
        return False
    if report.revoked:
        return True
    return not report.clean and not report.gaps()
