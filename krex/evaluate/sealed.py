"""The sealed evaluation (issue 42): a trusted driver, the reference and the candidate
each in a process of its own.

:func:`run_sealed` is the program an evaluation runs in a warm worker when its
isolation is ``process``.  It runs no code of the candidate's or the reference's: it
starts two callees (:mod:`krex.evaluate.callees`), each of which builds the cases'
arguments, binds the native dispatcher and only then imports its function.  Every call
of either side -- correctness, determinism, identity, timed, held out -- is the same
sequence of the dispatcher (``native/dispatch/dispatch.c``); this driver stamps both
ends of it with its own clock, reads the output's bytes the dispatcher copied as part
of the call, and decides after each timed call, unpredictably, whether to keep its
output for checking (a uniform sample, and always the last calls).  The A/B timing is
``krex.compare`` here, in the region this worker holds, over :class:`Side` callables;
the dispatch overhead is calibrated with empty calls and subtracted
(:class:`DispatchTimer`).  The candidate's CPU time beyond its dispatcher's thread
comes from the kernel (its cgroup).  The callees are stopped and killed (everything
they started too) before any file is written; the return value is JSON text.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from krex.evaluate import evidence, spec, timing, values
from krex.evaluate.callees import Callee, CalleeFailed, ready, spawn
from krex.evaluate.dispatch import OP_CALL, OP_EMPTY, OP_REFILL, BadOutput, CalleeGone, Refused
from krex.evaluate.onecore import OneCore
from krex.evaluate.sandbox import Sandbox, SandboxUnavailable, dumpable, is_dumpable, reach

CALIBRATION_CALLS = 41  # empty calls per side before the timing


@dataclass
class Overhead:
    """The dispatch's own cost: empty calls through the same loop, in nanoseconds."""

    spans_ns: list[int] = field(default_factory=list)
    nbytes: int = 0  # each empty call copied this much, as the timed calls' outputs are

    def quantile(self, q: float) -> int:
        s = sorted(self.spans_ns)
        return s[min(len(s) - 1, int(q * len(s)))] if s else 0

    def to_dict(self) -> dict[str, Any]:
        return {"calls": len(self.spans_ns), "copied_bytes": self.nbytes,
                "p50_us": self.quantile(0.5) / 1e3,
                "p99_us": self.quantile(0.99) / 1e3, "subtracted_us": self.quantile(0.5) / 1e3}


def run_sealed(job: dict[str, Any]) -> str:
    """The whole evaluation's evidence, as JSON text (see the module docstring)."""
    run = SealedRun(job)
    was = is_dumpable()
    if run.sandbox != "off":
        dumpable(False)  # the driver's memory (samples, outputs) unreadable to the candidate
    try:
        run.run()
    finally:
        run.close()
        dumpable(was)
    return json.dumps(run.out, default=str)


class SealedRun:
    def __init__(self, job: dict[str, Any]) -> None:
        self.job, self.device = job, job["device"]
        cases = job["cases"]
        self.slots = cases["correctness"] + cases["rotation"] + cases["identity"] \
            + cases["held_out"]
        self.ref_out: dict[str, Any] = {}
        self.cand_out: dict[str, Any] = {}
        self.out: dict[str, Any] = {"status": "ok", "isolation": "process", "pid": os.getpid(),
                                    "mutated": [], "aliases": [], "stage_s": {}}
        self.callees: list[Callee] = []
        self.rng = random.Random(secrets.randbits(64))  # nothing the candidate can seed
        self.deadline = time.monotonic() + float(job.get("timeout_s") or 120.0)
        self.sandbox = str(job.get("sandbox") or "auto")

    # -- start and stop ---------------------------------------------------------------

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            self.ref = self._start("reference")
            self.cand = self._start("candidate")
            self._stages(t0)
        except CalleeFailed as failed:
            self._failed(failed.role, failed.stage, failed.text, failed.exit_code)
        except Refused as refused:
            if refused.kind == "bad_output":
                self.out["bad_output"] = {"type": refused.text, "stage": refused.stage,
                                          "role": refused.role}
            self._failed(refused.role, refused.stage, f"{refused.kind}: {refused.text}", None)
        except CalleeGone as gone:
            self._failed(gone.role or "candidate", "call", gone.why, gone.exit_code, gone=True)
        except SandboxUnavailable as missing:
            self.out.update(status="sandbox_unavailable", exception=str(missing))
        self._account()  # whatever ended the stages: its cgroup still holds what it used

    def _start(self, role: str) -> Callee:
        sandbox = None
        if role == "candidate":
            files = [self.job[name]["path"] for name in ("candidate", "inputs")]
            files += [f for path in files for f in spec.reads(path)]
            sandbox = Sandbox(self.sandbox, reach(files), self._left())
        callee = spawn(role, self.job[role], self.job["inputs"], self.slots, sandbox,
                       hidden=self.sandbox != "off")
        self.callees.append(callee)
        if callee.confined is not None:
            self.out["sandbox"] = callee.confined.to_dict()
        return callee

    def _failed(self, role: str, stage: str, text: str, code: int | None,
                gone: bool = False) -> None:
        if role == "reference" or stage == "inputs":
            self.out.update(status="reference_error", exception=f"{stage}: {text}")
        elif gone and "no answer" in text:
            self.out.update(status="timeout", exception=text)
        elif gone or (code is not None and code < 0):
            self.out.update(status="crashed", exit_code=_shell_code(code), exception=text)
        else:
            self.out.update(status="error", stage=stage, exception=text)

    def close(self) -> None:
        for callee in self.callees:
            code = callee.stop()
            if callee.role == "candidate" and self.out["status"] == "crashed":
                self.out["exit_code"] = _shell_code(code)
        self.callees = []
        if self.out["status"] in ("ok", "error", "crashed", "timeout"):
            self._write()

    # -- the stages -------------------------------------------------------------------

    def _stages(self, t0: float) -> None:
        for callee in self.callees:
            ready(callee, self._left())
        accounting = self.cand.accounting
        self.usage0 = accounting.read() if accounting is not None else None
        stage = self.out["stage_s"]
        stage["prepare"], t1 = time.monotonic() - t0, time.monotonic()
        self._reference_outputs()
        self.out["provenance"] = _provenance(self.device)
        self.onecore = OneCore([c.pid for c in self.callees])
        self.out["one_cpu"] = self.onecore.pin()
        try:
            self._measured_stages(stage, t1)
        finally:
            self.onecore.restore()

    def _measured_stages(self, stage: dict[str, float], t1: float) -> None:
        """Calibration, the candidate's checks and the timing: the loop on one CPU."""
        self.overhead = self._calibrate(self._timed_bytes())
        stage["reference"], t1 = time.monotonic() - t1, time.monotonic()
        cases = self.job["cases"]
        for name, fn in (("correctness", lambda: self._checked(cases["correctness"])),
                         ("precheck", self._precheck),
                         ("determinism", lambda: self._checked(cases["correctness"][:1],
                                                               "determinism")),
                         ("identity", self._identity), ("timing", self._timing),
                         ("held_out", lambda: self._checked(cases["held_out"]))):
            fn()
            stage[name], t1 = time.monotonic() - t1, time.monotonic()

    def _account(self) -> None:
        """What the kernel counted for the candidate since it was imported: the CPU time
        of its cgroup beyond the threads it had before (the dispatcher's)."""
        cand = getattr(self, "cand", None)
        accounting = cand.accounting if cand is not None else None
        usage0 = getattr(self, "usage0", None)
        if cand is None or accounting is None or usage0 is None:
            return
        now = accounting.read()
        self.out["accounting"] = {
            "cpu_outside_ms": (now.candidates_ns - usage0.candidates_ns) / 1e6,
            "calls_ms": cand.block.calls_ns / 1e6,
            "threads_started": max(0, now.threads - len(accounting.krex_tids)),
            "processes": now.processes, "cgroup": accounting.path is not None,
            "limitation": accounting.limitation}

    def _left(self) -> float:
        return max(0.1, self.deadline - time.monotonic())

    def _call(self, callee: Callee, slot: int, stage: str, op: int = OP_CALL) -> Any:
        record = callee.block.call(op, slot, timeout_s=self._left())
        if record.status != "ok":
            raise Refused(callee.role, stage, record.status, record.message)
        return record

    def _output(self, callee: Callee, key: str, stage: str) -> Any:
        got = callee.block.output(key)
        if isinstance(got, BadOutput):
            raise Refused(callee.role, stage, "bad_output", got.type_name)
        return got

    def _timed_bytes(self) -> int:
        """Bytes of the reference's output on the timed shape (what each call copies)."""
        _, arrays = self.ref_out[self.job["cases"]["rotation"][0]["id"]]
        return sum(int(a.nbytes) for a in arrays.values())

    def _calibrate(self, nbytes: int) -> Overhead:
        """Empty calls through the same loop, each copying ``nbytes`` as an output."""
        overhead = Overhead(nbytes=nbytes)
        for _ in range(CALIBRATION_CALLS):
            for callee in self.callees:
                record = callee.block.call(OP_EMPTY, 0, nbytes, timeout_s=self._left())
                overhead.spans_ns.append(record.span_ns)
        self.out["dispatch"] = overhead.to_dict()
        return overhead

    def _reference_outputs(self) -> None:
        for case in self.job["reference_cases"]:
            self._call(self.ref, self.ref.slots[case["id"]], "reference")
            self.ref_out[case["id"]] = self._output(self.ref, case["id"], "reference")

    def _checked(self, cases: list[dict[str, Any]], label: str | None = None) -> None:
        for case in cases:
            key = label or case["id"]
            record = self._call(self.cand, self.cand.slots[case["id"]], case["stage"])
            self.cand_out[key] = self._output(self.cand, key, case["stage"])
            if record.aliases:
                self.out["aliases"].append({"output": "/", "input": "/", "case": case["id"]})
            if self.cand.block.mutated(self._left()):
                self.out["mutated"].append(case["id"])

    def _precheck(self) -> None:
        wrong = [c["id"] for c in self.job["cases"]["correctness"]
                 if values.compare(self.ref_out[c["id"]], self.cand_out[c["id"]],
                                   self.job.get("atol"), self.job.get("rtol"))]
        self.out["precheck_wrong"] = wrong

    def _identity(self) -> None:
        """The same input objects called again with another seed's contents: an output
        cached by the objects' identity (or address) reads as the old one."""
        first, second = self.job["cases"]["identity"]
        slot = self.cand.slots[first["id"]]
        self._call(self.cand, slot, "identity")
        self.cand.block.call(OP_REFILL, slot, self.cand.slots[second["id"]],
                             timeout_s=self._left())
        self.cand.block.mutated(self._left())  # the refill is done
        self._call(self.cand, slot, "identity")
        self.cand_out["identity"] = self._output(self.cand, "identity", "identity")
        self.out["identity_refilled"] = 1

    def _timing(self) -> None:
        if self.out.get("precheck_wrong"):
            self.out["timing_skipped"] = "outputs already wrong: " + ", ".join(
                self.out["precheck_wrong"])
            return
        timing.timed(self)

    # -- after ------------------------------------------------------------------------

    def _write(self) -> None:
        """The outputs as files for the evaluator, with their SHA-256 in the summary: the
        callees and everything they started are dead by now."""
        from krex.evaluate.worker import reference_digest

        path = os.path.join(self.job["dir"], "reference")
        values.save(path, {}, self.ref_out)
        values.save(path + ".inputs", {})
        with open(path + ".meta.json", "w") as f:
            json.dump({"input_hashes": self._input_hashes(), "pid": self.out["pid"]}, f)
        self.out["reference_sha256"] = reference_digest(path)
        path = os.path.join(self.job["dir"], "candidate")
        values.save(path, {}, self.cand_out)
        self.out["candidate_sha256"] = evidence.files_digest(path)


    def _input_hashes(self) -> dict[str, str]:
        """Provenance: each case's arguments as built here by the inputs builder (trusted,
        like the reference; the callees built theirs from the same seeds)."""
        from krex.evaluate.worker import build

        try:
            make = spec.load(spec.FnSpec.from_dict(self.job["inputs"]), "inputs")
            return {c["id"]: values.tree_digest(build(make, c)) for c in self.slots}
        except Exception:  # noqa: BLE001  (provenance only: the callees' builds were used)
            return {}


def _provenance(device: str) -> dict[str, Any]:
    """The driver's environment (the callees run the same interpreter and packages)."""
    import platform
    import sys

    info = {"python": platform.python_version(), "host": platform.node(),
            "timer": timing.DispatchTimer.name, "device": device}
    for name in ("numpy", "torch"):
        module = sys.modules.get(name)
        if module is not None:
            info[name] = getattr(module, "__version__", "?")
    return info


def _shell_code(code: int | None) -> int | None:
    """As a shell reports it: a signal N is 128 + N (SIGSEGV: 139)."""
    return None if code is None else (128 - code if code < 0 else code)
