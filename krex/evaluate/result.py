"""What ``krex.evaluate`` returns: :class:`Evaluation`, a plain, picklable record."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from krex.evaluate.findings import INVALID, Finding

EVALUATION_FORMAT = 1
VERDICTS = ("faster", "slower", "same", "unclear", "invalid")


@dataclass
class Evaluation:
    """Is the candidate correct, is it faster, and can the number be trusted?

    ``verdict`` is ``faster`` / ``slower`` / ``same`` / ``unclear`` from the
    A/B comparison, or ``invalid`` when any finding of severity ``invalid``
    was made (a wrong output, a crash, a hang, work the timer missed, ...).
    ``speedup`` = reference time / candidate time (above 1: faster), with its
    interval ``[ci_low, ci_high]``.
    """

    id: str
    created_at: str  # ISO 8601, UTC
    request_key: str  # same code, inputs and options -> same key (deduplication)
    device: str
    status: str  # ok | error | crashed | timeout | device_error (the candidate's program)
    verdict: str
    correct: bool | None
    speedup: float | None
    ci_low: float | None
    ci_high: float | None
    findings: list[Finding] = field(default_factory=list)
    reference: dict[str, str] = field(default_factory=dict)  # path, name, sha256
    candidate: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    correctness: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, Any] = field(default_factory=dict)  # the comparison, its region report
    integrity: dict[str, Any] = field(default_factory=dict)  # counters, probe, tampering
    provenance: dict[str, Any] = field(default_factory=dict)  # versions, driver, clocks, hashes
    elapsed_s: float = 0.0
    output_tail: str = ""  # the candidate program's last output (tracebacks, prints)
    reused: bool = False  # returned from the records, not measured again
    tenant: str | None = None  # the service's tenant it was made for (None: a local run)

    @property
    def ok(self) -> bool:
        """Correct, and the verdict is a trustworthy one (not invalid)."""
        return bool(self.correct) and self.verdict != "invalid"

    @property
    def invalid_findings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == INVALID]

    def codes(self) -> list[str]:
        return [f.code.name for f in self.findings]

    def summary(self) -> str:
        speed = "" if self.speedup is None or self.verdict == "invalid" else \
            f" {self.speedup:.3f}x [{self.ci_low:.3f}, {self.ci_high:.3f}]"  # never invalid's
        found = ", ".join(self.codes()) or "no findings"
        return f"{self.id}: {self.verdict}{speed}; correct={self.correct}; {found}"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["findings"] = [f.to_dict() for f in self.findings]
        out["ok"] = self.ok
        out["format"] = EVALUATION_FORMAT
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Evaluation:
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        kw["findings"] = [Finding.from_dict(f) for f in data.get("findings", [])]
        return cls(**kw)


def pooling(ev: dict[str, Any]) -> dict[str, Any]:
    """An evaluation's answer to "how much evidence": ``pooled_pairs`` (all the pairs its
    verdict is from, an unclear record's included) and ``extends`` (the record whose pairs
    it pooled, or None)."""
    timing = ev.get("timing") or {}
    pooled = timing.get("pooled") or {}
    return {"pooled_pairs": pooled.get("pairs", timing.get("pairs")),
            "extends": pooled.get("extends")}
