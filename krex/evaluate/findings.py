"""Findings: every named thing an evaluation can say about a candidate, with evidence.

Each :class:`Code` has a severity — ``invalid`` (the verdict becomes
``invalid``: the number cannot be trusted or the candidate is wrong),
``flag`` (reported, the verdict stands) or ``note`` — a summary and the next
action.  docs/evaluate.md has an example of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

INVALID, FLAG, NOTE = "invalid", "flag", "note"


class Code(Enum):
    # how the candidate's program ended
    CRASHED = (INVALID, "the candidate's worker died (signal or exit)",
               "run the candidate alone under a debugger; the worker was recycled")
    TIMEOUT = (INVALID, "the candidate did not finish within timeout_s (a hang)",
               "look for an infinite loop or a deadlock; raise timeout_s if it is just slow")
    DEVICE_ERROR = (INVALID, "the candidate left a sticky device error",
                    "run it under compute-sanitizer; the worker was recycled")
    CANDIDATE_ERROR = (INVALID, "the candidate raised an exception",
                       "read the traceback in the evidence")
    # correctness
    WRONG_OUTPUT = (INVALID, "outputs differ from the reference beyond tolerance",
                    "compare against the reference on the failing seed; check precision")
    WRONG_SHAPE = (INVALID, "an output has the wrong shape", "return the reference's shape")
    WRONG_DTYPE = (INVALID, "an output has the wrong dtype", "return the reference's dtype")
    WRONG_STRUCTURE = (INVALID, "the outputs are nested differently from the reference's",
                       "return the same tuple/list/dict structure as the reference")
    NON_FINITE = (INVALID, "NaN or Inf where the reference is finite",
                  "look for overflow, division by zero or uninitialised memory")
    WRONG_ON_HELD_OUT = (INVALID, "wrong on a shape or seed first seen after timing",
                         "the candidate is specialised to the timed inputs; make it general")
    WRONG_DURING_TIMING = (INVALID, "outputs of the timed calls were wrong (early return, "
                           "stale result)", "every call must compute its own inputs' result")
    STALE_OUTPUT = (INVALID, "the same input objects with new contents gave the old result "
                    "(output cached by input identity)", "do not cache on object identity")
    INPUT_MUTATED = (INVALID, "the candidate wrote to its inputs",
                     "work on copies or in outputs it allocates")
    OUTPUT_ALIASES_INPUT = (INVALID, "an output shares memory with an input",
                            "return newly allocated outputs")
    NONDETERMINISTIC = (INVALID, "two calls on identical inputs disagree beyond tolerance",
                        "look for races or uninitialised memory")
    OUTPUT_NOT_A_BUFFER = (INVALID, "an output is not an exact numpy array, torch tensor, "
                           "tuple, list, str-keyed dict or plain value (a lookalike class, a "
                           "subclass, a lazy object): krex copies only real buffers",
                           "return numpy.ndarray / torch.Tensor objects themselves")
    # integrity of the timing
    WORK_AFTER_RETURN = (INVALID, "work ran after a timed call returned (side stream, second "
                         "context or background thread): the timer missed it",
                         "finish all work (sync your streams, join threads) before returning")
    NO_DEVICE_WORK = (INVALID, "the candidate launched no device work in its timed calls",
                      "run the kernel on the device being timed")
    LAUNCH_COUNT_VARIES = (INVALID, "device launches per call varied wildly between calls",
                           "launch the same work on every call")
    KREX_TAMPERED = (INVALID, "krex's modules, the timer or the statistics were modified "
                     "by the candidate", "do not patch time, krex or numpy from the candidate")
    TIMER_IMPLAUSIBLE = (INVALID, "the timed samples do not fit in the region's hold time "
                         "measured by the daemon", "do not patch the clocks; rerun")
    IMPLAUSIBLE_SPEEDUP = (FLAG, "the speedup is beyond the plausibility bound",
                           "check the candidate by hand before believing it")
    TIMING_UNTRUSTED = (FLAG, "the timed samples were disturbed (the region was not clean: "
                        "its holder preempted, a foreign task on its cores, revoked, "
                        "throttled) even when measured again: the verdict is unclear",
                        "read the warnings; rerun when the machine is quieter (or with the "
                        "shield on, so unmanaged tasks are moved off the holder's cores)")
    TIMING_NOT_ENFORCED = (FLAG, "exclusivity was not (fully) enforced on this machine or "
                           "daemon; nothing was seen to disturb the samples",
                           "read the warnings; run under a daemon that can gate and freeze")
    TIMING_SCREENED = (NOTE, "other tasks took the holder's core during the timing: the A/B "
                       "pairs they hit were set aside, the verdict is from the rest",
                       "nothing to do; a quieter machine needs fewer pairs")
    TIMING_FAILED = (FLAG, "the timing could not be completed", "read the evidence; rerun")
    NOT_BITWISE_DETERMINISTIC = (NOTE, "two calls on identical inputs differ within tolerance",
                                 "fine for floating-point reductions in parallel")
    NO_HELD_OUT_SHAPE = (NOTE, "only one shape was given: held out were new seeds only",
                         "give more shapes to check generality: --shapes "
                         "'[[timed], [other], ...]' (CLI), shapes=[timed_shape, other_shape, "
                         "...] (Python, HTTP, MCP), or SHAPES = [...] beside the inputs builder")

    def __init__(self, severity: str, summary: str, next_action: str) -> None:
        self.severity = severity
        self.summary = summary
        self.next_action = next_action


@dataclass
class Finding:
    code: Code
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def severity(self) -> str:
        return self.code.severity

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code.name, "severity": self.severity, "message": self.message,
                "evidence": self.evidence, "next_action": self.code.next_action}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(Code[data["code"]], str(data.get("message", "")), dict(data.get("evidence", {})))


def invalidating(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == INVALID]
