"""``krex.evaluate``: plan the cases, run the program in a warm worker, judge, record.

A pure pipeline over ``workers`` (through the daemon's pool, the same one
``krex exec`` uses) and ``measure`` (``compare``, run inside the candidate's
worker): no transport code here.  One program per evaluation: it computes
the reference's outputs and announces their SHA-256 on stdout before it
imports the candidate, then runs the candidate.  Outputs come back as files
in a private directory and are judged in this process, where no candidate
code runs; reference files that do not match the announcement fail the
evaluation.
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import json
import math
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from krex.client.connection import ACTING_FOR
from krex.errors import EvaluationFailed
from krex.evaluate import evidence, references, spec, values
from krex.evaluate import judge as judging
from krex.evaluate.findings import Code, Finding
from krex.evaluate.result import Evaluation
from krex.evaluate.sandbox import MODES as SANDBOX_MODES

OUTPUT_TAIL_CHARS = 4000
ROTATION_SEED, HELD_OUT_SEED, IDENTITY_SEED = 1000, 2000, 3000
MIN_PAIRS = 30  # compare's floor before it may stop on a clear verdict (12 cost `same`
# verdicts in bench_evaluate: 27/32 right, against 32/32 with 30) ...
EARLY_PAIRS = 10  # ... unless the effect is material: the stricter interval wholly beyond
# the ±2w band (a large true effect needs few pairs; 10 is where a sign-test interval
# reaches compare's stricter 99.8 % at all)
WARMUP_MS = 0.0  # two calls per side (the first, one more): both sides ran several times
# before the timing, and 1 ms (2-10 calls) cost 7 % of the workers' CPU for no better verdicts
ANNOUNCE_WITHIN_CHARS = 1 << 20  # stdout read for the reference announcement, at most
SEALED_MARGIN_S = 30.0  # the sealed driver's time beyond the candidate's (start, files)
MIN_MEASURED_S = 0.005  # ... and of measured time (cold flushes cost far more than kernels)


def evaluate(
    reference: str | Callable[..., Any],
    candidate: str | Callable[..., Any],
    inputs: str | Callable[..., Any],
    *,
    device: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seeds: int = 3,
    shapes: list[Any] | None = None,
    cache: str = "cold",
    rotation: int = 4,
    same_within: float = 0.03,
    confidence: float = 0.99,
    max_time_s: float = 1.0,
    timing_timeout_s: float = 3.0,
    timeout_s: float = 120.0,
    plausible_speedup: float | None = 50.0,
    fresh: bool = False,
    records: str | None = None,
    save: bool = True,
    label: str | None = None,
    isolation: str | None = None,
    sandbox: str = "auto",
) -> Evaluation:
    """Is ``candidate`` correct against ``reference``, and faster?  See docs/evaluate.md.

    ``reference`` and ``candidate`` take the positional arguments that
    ``inputs(seed)`` — or ``inputs(seed, shape)`` — returns (a tuple, or one
    value).  ``shapes[0]`` is timed; the other shapes are held out (checked
    only after the timing).  ``atol``/``rtol`` override the dtype defaults
    (fp32 1e-4, fp16/bf16 1e-2, fp64 1e-7; integers exact).  An identical
    request (same code, inputs builder and options) returns the stored
    record unless ``fresh=True``.  ``isolation``: ``process`` (the reference, the
    candidate and the trusted driver each in a process of their own: the default on
    ``cpu``) or ``worker`` (one program in the candidate's worker: the default on
    devices, where the counters of the interposer are read in-process).  ``sandbox``
    (``process`` only): ``auto`` confines the candidate's process as far as this machine
    allows and records what it could not (``integrity.sandbox``), ``required`` refuses
    to evaluate without all of it, ``off`` runs it as the driver does.
    """
    if seeds < 1 or rotation < 2:
        raise ValueError("need seeds >= 1 and rotation >= 2")
    if isolation not in (None, "process", "worker"):
        raise ValueError(f"isolation must be 'process' or 'worker', not {isolation!r}")
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"sandbox must be one of {', '.join(SANDBOX_MODES)}, not {sandbox!r}")
    specs = {"reference": spec.of(reference, "reference"),
             "candidate": spec.of(candidate, "candidate"), "inputs": spec.of(inputs, "inputs")}
    device = device or os.environ.get("KREX_DEVICE") or "cpu"
    shape_list = _jsonable(shapes if shapes is not None else _declared_shapes(inputs, specs))
    isolation = isolation or ("process" if device == "cpu" else "worker")
    options = {"atol": atol, "rtol": rtol, "seeds": seeds, "shapes": shape_list, "cache": cache,
               "rotation": rotation, "same_within": same_within, "confidence": confidence,
               "max_time_s": max_time_s, "timing_timeout_s": timing_timeout_s,
               "plausible_speedup": plausible_speedup, "isolation": isolation}
    if isolation == "process":
        options["sandbox"] = sandbox
    key = request_key(specs, device, options)
    tenant = ACTING_FOR.get()  # a service's job: its records are that tenant's alone
    stored = _stored(records, key, tenant) if not fresh and save else None
    if stored is not None and not extendable(stored):
        return stored
    evaluation = _run(specs, device, options, key, timeout_s, label)
    evaluation.tenant = tenant
    if stored is not None:
        evaluation = pooled(stored, evaluation, options)
    if save:
        from krex.records import RecordStore

        with RecordStore(records) as store:
            store.save(evaluation.to_dict())
    return evaluation


def extendable(stored: Evaluation) -> bool:
    """An ``unclear`` record of a correct candidate with its samples: an identical request
    adds pairs to it (:func:`pooled`) rather than returning it or starting afresh."""
    timing = stored.timing or {}
    return stored.verdict == "unclear" and stored.correct is True \
        and not stored.invalid_findings and bool(_samples(timing)[0])


def pooled(old: Evaluation, new: Evaluation, options: dict[str, Any]) -> Evaluation:
    """``new`` with ``old``'s pairs pooled in: the interval and the verdict are those of
    all the pairs, so resubmitting gains evidence and never a fresh draw of the noise.
    A candidate now invalid stays invalid; pairs krex distrusts decide nothing."""
    if new.verdict == "invalid" or not _samples(new.timing or {})[0]:
        return new
    from krex.measure.compare import speedup_interval

    (old_a, old_b), (new_a, new_b) = _samples(old.timing), _samples(new.timing)
    ref, cand = [*old_a, *new_a], [*old_b, *new_b]
    ratios = [math.log(a / b) for a, b in zip(ref, cand, strict=True) if a > 0 and b > 0]
    speedup, low, high = speedup_interval(ratios, options["confidence"])
    interval = {"speedup": speedup, "ci_low": low, "ci_high": high}
    untrusted = any(f.code is Code.TIMING_UNTRUSTED for f in new.findings)
    new.verdict = "unclear" if untrusted else \
        judging.timing_verdict(interval, options["same_within"])
    new.speedup, new.ci_low, new.ci_high = speedup, low, high
    new.timing = {**new.timing, "pooled": {
        "extends": old.id, "pairs": len(ratios), **interval,
        "reference_samples_ms": ref, "candidate_samples_ms": cand}}
    return new


def _samples(timing: dict[str, Any]) -> tuple[list[float], list[float]]:
    """The paired samples behind a record's verdict: its pooled ones where it has them."""
    source = timing.get("pooled") or timing
    return (list(source.get("reference_samples_ms") or []),
            list(source.get("candidate_samples_ms") or []))


def request_key(specs: dict[str, spec.FnSpec], device: str, options: dict[str, Any]) -> str:
    from krex.version import __version__

    data = {"specs": {k: [s.name, s.sha256] for k, s in specs.items()}, "device": device,
            "options": options, "krex": __version__}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _stored(records: str | None, key: str, tenant: str | None) -> Evaluation | None:
    from krex.records import RecordStore

    with RecordStore(records) as store:
        found = store.latest_for(key, tenant)
    if found is None:
        return None
    evaluation = Evaluation.from_dict(found)
    evaluation.reused = True
    return evaluation


def _declared_shapes(inputs: Any, specs: dict[str, spec.FnSpec]) -> list[Any]:
    """``SHAPES = [...]`` beside the inputs builder (read with ast, never executed)."""
    declared = getattr(inputs, "shapes", None) if callable(inputs) else None
    if declared is not None:
        return list(declared)
    with open(specs["inputs"].path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SHAPES"
                                                for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                break
    return [None]


def _jsonable(shapes: list[Any]) -> list[Any]:
    shapes = list(shapes) or [None]
    return json.loads(json.dumps(shapes))


def plan(options: dict[str, Any]) -> dict[str, Any]:
    """Every case of one evaluation: ids, seeds, shapes, stages."""
    shapes = options["shapes"]
    timed = shapes[0]

    def case(cid: str, seed: int, shape: Any, stage: str) -> dict[str, Any]:
        return {"id": cid, "seed": seed, "shape": shape, "stage": stage}

    held = [case(f"h{j}", HELD_OUT_SEED + j, s, "held_out") for j, s in enumerate(shapes[1:])]
    return {
        "shapes": shapes,
        "correctness": [case(f"c{i}", i, timed, "correctness") for i in range(options["seeds"])],
        "rotation": [case(f"r{i}", ROTATION_SEED + i, timed, "timing")
                     for i in range(options["rotation"])],
        "identity": [case("i0", IDENTITY_SEED, timed, "identity"),
                     case("i1", IDENTITY_SEED + 1, timed, "identity")],
        "held_out": held or [case("h0", HELD_OUT_SEED, timed, "held_out")],
    }


def _workdir() -> str:
    """The evaluation's working directory, where its programs write their outputs: given
    to the tenant's user where they run as one (a service's job on a root node)."""
    workdir = tempfile.mkdtemp(prefix="krex-evaluate-")
    if ACTING_FOR.get() is not None:
        from krex.client import Client

        with Client() as client:
            run_as, _ = client.program_user()
        if run_as is not None:
            run_as.give(workdir)
    return workdir


def _new_id() -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"ev-{stamp}-{secrets.token_hex(3)}"


def _run(specs: dict[str, spec.FnSpec], device: str, options: dict[str, Any], key: str,
         timeout_s: float, label: str | None, use_cache: bool = True) -> Evaluation:
    evaluation_id, t0 = _new_id(), time.monotonic()
    cases = plan(options)
    workdir = _workdir()
    try:
        job = _job(specs, device, options, cases, workdir, label or f"evaluate {evaluation_id}")
        sealed = options.get("isolation") == "process"
        ref_key = references.key(job["reference"], job["inputs"], job["reference_cases"], device)
        known = references.REFERENCES.get(ref_key) if use_cache and not sealed else None
        job["reference_known"] = known is not None
        if known is not None:  # the inputs as built before, each checked by its hash there
            job["input_hashes"] = known.meta.get("input_hashes", {})
            job["kept_inputs"] = known.write_inputs(os.path.join(workdir, "kept-inputs"))
            job["kept_sealed"] = known.sealed_inputs()  # read first: no hashing needed
            job["kept_structures"] = known.blobs[3].decode() if job["kept_sealed"] else None
        job["timeout_s"] = timeout_s
        cand_result, tail, announced = _program(job, device, timeout_s, sealed)
        if known is not None and announced is not None and announced != known.inputs \
                and not _reference_failed(cand_result):
            references.REFERENCES.drop(ref_key)  # this worker built other inputs: no cache
            return _run(specs, device, options, key, timeout_s, label, use_cache=False)
        entry, changed = _reference(os.path.join(workdir, "reference"), announced,
                                    cand_result, tail, known)
        ref_tree, ref_meta = _reference_tree(entry, known is not None)
        if known is None and entry is not None and not sealed:
            references.REFERENCES.put(ref_key, entry)
        summary, status, early = _candidate_outcome(cand_result, timeout_s)
        cand_tree, rewritten = evidence.candidate_tree(
            os.path.join(workdir, "candidate"), summary, _load_if_there)
        early += [rewritten] if rewritten else []
        if known is not None and job.get("kept_inputs") \
                and summary.get("inputs_kept", 0) < known.kept_cases:
            known.forget_copy()  # a case did not hash as kept: rewritten through its link?
        early += [changed] if changed else []
        verdict_of = judging.judge(cases, ref_tree, cand_tree, summary, options)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    findings = early + verdict_of.findings
    comparison = summary.get("comparison") or {}
    return Evaluation(
        id=evaluation_id, created_at=_now(), request_key=key, device=device, status=status,
        verdict="invalid" if early else verdict_of.verdict,
        correct=False if early and verdict_of.correct is None else verdict_of.correct,
        speedup=comparison.get("speedup"), ci_low=comparison.get("ci_low"),
        ci_high=comparison.get("ci_high"), findings=findings,
        reference=specs["reference"].to_dict(), candidate=specs["candidate"].to_dict(),
        inputs=specs["inputs"].to_dict(), options={**options, "timeout_s": timeout_s},
        correctness=verdict_of.correctness, timing=comparison,
        integrity=_integrity(summary), provenance=_provenance(summary, ref_meta, cand_result),
        elapsed_s=time.monotonic() - t0, output_tail=tail[-OUTPUT_TAIL_CHARS:],
    )  # fmt: skip


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def _job(specs: dict[str, spec.FnSpec], device: str, options: dict[str, Any],
         cases: dict[str, Any], workdir: str, label: str) -> dict[str, Any]:
    ref_cases = cases["correctness"] + cases["rotation"] + cases["identity"][1:] \
        + cases["held_out"]
    # compare stops once its interval is within ±2w (our "same") or outside it with 1 excluded
    timing = {"cache": options["cache"], "same_within": 2 * options["same_within"],
              "confidence": options["confidence"], "max_time_s": options["max_time_s"],
              "timeout_s": options["timing_timeout_s"], "min_pairs": MIN_PAIRS,
              "early_pairs": EARLY_PAIRS, "decisive_only": True,  # see compare()
              "same_at_confidence": True,  # same-speed pairs were ~2/3 of the cpu hold
              "screen_offcpu": True,  # pairs with a preempted sample set aside (cpu)
              "order": "random",  # ABBA favours B by 1-3 % on cpu: the stopping check runs
              # between blocks, just before every block's first A sample
              "min_time_s": MIN_MEASURED_S, "warmup_ms": WARMUP_MS,
              "estimate_calls": 0}  # both sides ran before: groups sized in the region
    return {"inputs": specs["inputs"].to_dict(), "reference": specs["reference"].to_dict(),
            "dir": workdir, "device": device, "reference_cases": ref_cases,
            "candidate": specs["candidate"].to_dict(), "cases": cases, "timing": timing,
            "label": label, "atol": options["atol"], "rtol": options["rtol"],
            "sandbox": options.get("sandbox", "auto")}


class _Output:
    """The program's output: a bounded tail, and the first reference announcement on stdout."""

    def __init__(self, mark: str) -> None:
        self.mark = mark
        self.chunks: list[str] = []
        self.head: str | None = ""  # stdout so far, until the announcement is found
        self.announced: str | None = None

    def __call__(self, stream: str, text: str) -> None:
        self.chunks.append(text)
        if len(self.chunks) > 256:
            del self.chunks[:128]
        if stream != "stdout" or self.announced is not None or self.head is None:
            return
        self.head += text  # only until the announcement (it comes before any candidate code)
        at = self.head.find(self.mark)
        end = self.head.find("\n", at) if at >= 0 else -1
        if end >= 0:
            self.announced, self.head = self.head[at + len(self.mark):end].strip(), None
        elif len(self.head) > ANNOUNCE_WITHIN_CHARS:
            self.head = None  # the reference printed this much first: no announcement taken

    def tail(self) -> str:
        return "".join(self.chunks)


def _program(job: dict[str, Any], device: str, timeout_s: float,
             sealed: bool) -> tuple[Any, str, str | None]:
    """(result, output tail, the announced SHA-256 of the reference's files).  Sealed:
    the driver's summary (JSON text, no pickle) names the digest of the files it wrote
    once the callees were dead; the driver gets a margin beyond the candidate's time."""
    from krex.evaluate import sealed as sealing
    from krex.evaluate import worker

    sink = _Output(worker.REFERENCE_MARK)
    if sealed:
        result = _submit(sealing.run_sealed, job, device, timeout_s + SEALED_MARGIN_S, sink)
        summary = evidence.summary(result)
        return result, sink.tail(), None if summary is None else summary.get("reference_sha256")
    result = _submit(worker.run_candidate, job, device, timeout_s, sink)
    return result, sink.tail(), sink.announced


def _submit(fn: Callable[..., Any], job: dict[str, Any], device: str, timeout_s: float,
            sink: Callable[[str, str], None]) -> Any:
    from krex.client import Client
    from krex.workers import ExecRequest

    req = ExecRequest.for_callable(fn, job)
    req.timeout_s = timeout_s
    with Client() as client:
        return client.execute(req, device=device, on_output=sink)


def _reference(path: str, announced: str | None, result: Any, tail: str,
               known: references.Entry | None) -> tuple[references.Entry | None, Finding | None]:
    """The reference's outputs as announced before the candidate was imported (or as this
    process already holds them), or a finding when the files no longer match the
    announcement."""
    ended = evidence.summary(result) if result.status == "ok" else None
    if isinstance(ended, dict) and ended.get("status") == "sandbox_unavailable":
        raise EvaluationFailed(f"the candidate's sandbox could not be applied here "
                               f"(sandbox='required'): {ended.get('exception')}")
    if _reference_failed(result):
        summary = evidence.summary(result) or {}
        raise EvaluationFailed(f"the reference or the inputs builder failed: "
                               f"{summary.get('exception')}\n"
                               f"{str(summary.get('traceback') or tail)[-2000:]}")
    if announced is None:
        why = result.exception or f"{result.status} (exit code {result.exit_code})"
        raise EvaluationFailed(f"the reference's outputs were never announced: {why}\n"
                               f"{(result.traceback or tail)[-2000:]}")
    if known is not None:
        return known, None
    try:
        blobs = references.read(path)
        found = references.digest_of(blobs)
        entry = references.Entry(blobs, announced) if found == announced else None
    except (OSError, ValueError) as exc:
        return None, Finding(Code.KREX_TAMPERED, "the reference's outputs, written before "
                             f"the candidate was imported, could not be read: {exc}", {})
    if entry is None:
        return None, Finding(Code.KREX_TAMPERED, "the reference's outputs changed after "
                             "the candidate was imported", {"sha256": found,
                                                            "announced": announced})
    return entry, None


def _reference_tree(entry: references.Entry | None, cached: bool) -> tuple[Any, dict[str, Any]]:
    if entry is None:
        return None, {}
    try:
        return entry.tree(), {**entry.meta, "cached": cached}
    except (OSError, ValueError) as exc:
        raise EvaluationFailed(f"the reference's outputs could not be read: {exc}") from None


def _reference_failed(result: Any) -> bool:
    summary = evidence.summary(result) if result.status == "ok" else None
    return isinstance(summary, dict) and summary.get("status") == "reference_error"


def _load_if_there(path: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    if not os.path.exists(path + ".json"):
        return None
    try:
        return values.load(path)
    except (OSError, ValueError) as exc:
        raise EvaluationFailed(f"the candidate's outputs could not be read: {exc}") from None


def _candidate_outcome(result: Any, timeout_s: float) -> tuple[dict[str, Any], str, list[Finding]]:
    """(summary, status, findings about how the program ended)."""
    early: list[Finding] = []
    if result.status == "ok":
        summary = dict(evidence.summary(result) or {})
        if summary.get("status") == "timeout":
            early.append(Finding(Code.TIMEOUT, f"no result within {timeout_s:g} s; the "
                                 "candidate's process was killed", {"timeout_s": timeout_s}))
            return summary, "timeout", early
        if summary.get("status") == "crashed":
            code = summary.get("exit_code")
            early.append(Finding(Code.CRASHED, f"exit code {code}",
                                 {"exit_code": code, "traceback": summary.get("exception")}))
            return summary, "crashed", early
        status = "ok" if summary.get("status") == "ok" else "error"
    elif result.status == "timeout":
        summary, status = {}, "timeout"
        early.append(Finding(Code.TIMEOUT, f"no result within {timeout_s:g} s; the worker was "
                             "killed", {"timeout_s": timeout_s}))
    elif result.status == "crashed":
        summary, status = {}, "crashed"
        early.append(Finding(Code.CRASHED, f"exit code {result.exit_code}",
                             {"exit_code": result.exit_code,
                              "traceback": (result.traceback or "")[-4000:]}))
    else:
        raise EvaluationFailed(f"the candidate's program ended {result.status}: "
                               f"{result.exception}\n{(result.traceback or '')[-2000:]}")
    if (result.recycle_reason or "").startswith("device_error"):
        status = "device_error"
        early.append(Finding(Code.DEVICE_ERROR, result.recycle_reason, {}))
    summary["worker_recycled"] = result.recycle_reason
    return summary, status, early


def _integrity(summary: dict[str, Any]) -> dict[str, Any]:
    keys = ("isolation", "sandbox", "dispatch", "accounting", "between_calls",
            "reference_between_calls", "one_cpu", "checked_timed", "bad_output",
            "counters", "probe", "bursts", "probe_error", "probe_skipped", "tampered",
            "threads_started",
            "identity_refilled", "timing_skipped", "precheck_wrong", "mutated", "aliases",
            "inputs_kept", "inputs_sealed",
            "worker_recycled", "stage_s", "timing_error")
    return {k: summary[k] for k in keys if k in summary}


def _provenance(summary: dict[str, Any], ref_meta: dict[str, Any], cand: Any) -> dict[str, Any]:
    from krex.version import __version__

    return {**summary.get("provenance", {}), "krex_version": __version__,
            "input_hashes": ref_meta.get("input_hashes", {}), "clocks": summary.get("clocks"),
            "reference_worker_pid": ref_meta.get("pid"), "candidate_worker_pid": cand.worker_pid,
            "reference_cached": ref_meta.get("cached", False)}
