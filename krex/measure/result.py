"""What measurements return: :class:`Measurement` and :class:`Comparison`.

Plain dataclasses: picklable, with ``to_dict()`` giving JSON-ready dicts
(warnings as their names, each with its next action; region reports in their
serialised form).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from krex.measure.checks import Finding, MeasureWarning
from krex.protocol.report import RegionReport

RESULT_FORMAT = 2  # 2: region reports in RegionReport form (reasons, outcome)


def warnings_dicts(warnings: list[MeasureWarning], details: dict[str, str]) -> list[dict]:
    return [
        {"warning": w.name, "detail": details.get(w.name, ""), "next_action": w.next_action}
        for w in warnings
    ]


def _plain(result: Any) -> dict[str, Any]:
    """A result's fields as JSON-ready values: reports serialised, warnings with actions."""
    out = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    out["region"] = result.region.to_dict()
    out["rejected_regions"] = [r.to_dict() for r in result.rejected_regions]
    out["warnings"] = warnings_dicts(result.warnings, result.warning_details)
    del out["warning_details"]
    out["format"] = RESULT_FORMAT
    return out


def split_findings(findings: list[Finding]) -> tuple[list[MeasureWarning], dict[str, str]]:
    """Deduplicated warnings in order, and their details joined by '; '."""
    warnings: list[MeasureWarning] = []
    details: dict[str, str] = {}
    for kind, detail in findings:
        if kind not in warnings:
            warnings.append(kind)
            details[kind.name] = detail
        elif detail:
            details[kind.name] = f"{details[kind.name]}; {detail}".strip("; ")
    return warnings, details


@dataclass
class Measurement:
    """Samples of one function in one region, their statistics and their evidence."""

    samples_ms: list[float]
    device: str
    timer: str
    min_ms: float
    median_ms: float
    mean_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    stdev_ms: float
    noise_rel: float  # robust: 1.4826 * MAD / median
    stdev_rel: float  # stdev / mean
    stop_reason: str
    noise_target: float | None
    cache: str
    warmup_iterations: int
    estimate_ms: float
    elapsed_s: float  # wall time of the timed loop, flushes included
    region: RegionReport
    attempts: int = 1
    rejected_regions: list[RegionReport] = field(default_factory=list)
    clocks_start: dict[str, Any] = field(default_factory=dict)
    clocks_end: dict[str, Any] = field(default_factory=dict)
    offcpu_fraction: float | None = None  # cpu timer: share of wall time off the CPU
    cuda_graph: bool = False
    label: str | None = None
    warnings: list[MeasureWarning] = field(default_factory=list)
    warning_details: dict[str, str] = field(default_factory=dict)
    flush_bytes: int | None = None  # bytes written per cold-cache flush (None: hot cache)
    overhead_ms: float | None = None  # per sample, outside the timed interval (flush, marks)
    hints: list[str] = field(default_factory=list)  # cost hints: "kind: text (next action)"

    @property
    def iterations(self) -> int:
        return len(self.samples_ms)

    @property
    def trusted(self) -> bool:
        """No warnings at all: the number and its region are clean."""
        return not self.warnings

    def to_dict(self) -> dict[str, Any]:
        out = _plain(self)
        out["iterations"] = self.iterations
        out["trusted"] = self.trusted
        return out


@dataclass
class Comparison:
    """A/B result: speedup = baseline time / candidate time, with its interval."""

    verdict: str  # faster | slower | same | unclear (the candidate relative to baseline)
    speedup: float
    ci_low: float
    ci_high: float
    confidence: float
    same_within: float
    pairs: int
    order: str
    stop_reason: str
    baseline: dict[str, float]  # summary statistics of the baseline samples
    candidate: dict[str, float]
    baseline_samples_ms: list[float]
    candidate_samples_ms: list[float]
    region: RegionReport
    device: str
    timer: str
    elapsed_s: float
    attempts: int = 1
    rejected_regions: list[RegionReport] = field(default_factory=list)
    warnings: list[MeasureWarning] = field(default_factory=list)
    warning_details: dict[str, str] = field(default_factory=dict)
    flush_bytes: int | None = None  # bytes written per cold-cache flush (None: hot cache)
    overhead_ms: float | None = None  # per sample, outside the timed interval (flush, marks)
    hints: list[str] = field(default_factory=list)
    screened: bool = False  # pairs with a preempted sample were set aside (screen_offcpu)
    discarded_pairs: int = 0  # ... this many, not in the samples above

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)
