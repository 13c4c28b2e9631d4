"""The one program an evaluation runs in a warm worker: :func:`run_candidate`.

Everything happens in one worker, in this order: load the inputs builder
and the reference, build every case from its seed and call the reference
on it, write the reference's outputs (``reference.json``/``.bin``, with the
inputs' hashes) and announce their SHA-256 on stdout — *before* the
candidate exists, so the evaluator can tell if anything changed them later
—, warm the measuring machinery, take the thread baseline and the
fingerprint of trusted modules, *then* import the candidate; correctness
cases (fresh inputs per call, mutation and aliasing checked), the
determinism re-run, the identity probe (same input objects, new contents),
the A/B timing through ``krex.compare`` with input rotation and counters
around every sample, the return probe at the end of the region, the
held-out cases, and the fingerprint again.  Outputs go to files
(``values.save``); the returned dict is small and JSON-able.  Judging
happens in the evaluator, never here: this process ran the candidate's code.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from krex.errors import KrexError
from krex.evaluate import counters, guard, probe, readings, spec, values


def build(make: Callable[..., Any], case: dict[str, Any]) -> tuple[Any, ...]:
    """The positional arguments of one case: ``make(seed)`` or ``make(seed, shape)``."""
    shape = _tuples(case.get("shape"))
    args = make(case["seed"]) if shape is None else make(case["seed"], shape)
    return tuple(args) if isinstance(args, (tuple, list)) else (args,)


def _tuples(shape: Any) -> Any:
    """Shapes travel as JSON lists; builders get tuples back."""
    return tuple(_tuples(s) for s in shape) if isinstance(shape, list) else shape


REFERENCE_MARK = "krex-evaluate-reference-sha256:"  # the announcement's prefix on stdout
REFERENCE_FILES = (".json", ".bin", ".meta.json", ".inputs.json", ".inputs.bin")  # after the
# ``reference`` path, in digest order: outputs, their metadata, the built inputs (plain ones)


def reference_digest(path: str) -> str:
    """SHA-256 over the reference's files, in :data:`REFERENCE_FILES` order."""
    h = hashlib.sha256()
    for suffix in REFERENCE_FILES:
        with open(path + suffix, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def inputs_digest(hashes: dict[str, str]) -> str:
    """One SHA-256 over the inputs' hashes by case: what a worker announces when the
    evaluator already holds the reference's outputs (krex.evaluate.references)."""
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


class ReferenceFailed(Exception):
    """The inputs builder or the reference raised: no verdict, the request is broken."""


PROBE_HOLD_S = 20.0  # the region's maximum hold beyond the timing loop: the return probe


class Stage(Exception):
    """The candidate failed in one stage; carries what was gathered so far."""

    def __init__(self, stage: str, exc: BaseException) -> None:
        super().__init__(stage)
        self.stage = stage
        self.text = f"{type(exc).__name__}: {exc}"
        self.trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _call(stage: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except BaseException as exc:  # noqa: BLE001  (SystemExit too: the candidate's failure)
        raise Stage(stage, exc) from None


def run_candidate(job: dict[str, Any]) -> dict[str, Any]:
    run = CandidateRun(job)
    t0 = time.monotonic()
    try:
        run.reference()
    except ReferenceFailed as exc:
        return {"status": "reference_error", "exception": str(exc),
                "traceback": traceback.format_exc()[-8000:]}
    t1 = time.monotonic()
    try:
        run.prepare()
        run.stages()
    except Stage as failed:
        run.out.update({"status": "error", "stage": failed.stage, "exception": failed.text,
                        "traceback": failed.trace[-8000:]})
    t2 = time.monotonic()
    run.finish()
    run.out["stage_s"].update(reference=t1 - t0, finish=time.monotonic() - t2)
    return run.out


class CandidateRun:
    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.device: str = job["device"]
        self.outputs: dict[str, Any] = {}
        self.copies: dict[str, Any] = {}  # host copies taken right after the call
        self.expected: dict[str, Any] = {}  # reference outputs of the correctness cases
        self.skip_timing = False
        self.out: dict[str, Any] = {"status": "ok", "pid": os.getpid(), "mutated": [],
                                    "aliases": [], "stage_s": {}}
        self.fingerprint: guard.Guard | None = None
        self.built: dict[str, Any] = {}  # case id -> arguments as built, never handed out
        self.trusted: list[str] = []

    def args(self, case: dict[str, Any]) -> tuple[Any, ...]:
        """Fresh arguments of one case: a copy of the ones built for it — or built again
        when a copy could differ from a fresh build (views, objects other than arrays)."""
        pristine = self.built.get(case["id"])
        if pristine is None:
            pristine = build(self.make, case)
            if not values.copyable(pristine):
                return pristine
            self.built[case["id"]] = pristine
        return values.copy_tree(pristine)

    # -- before the candidate exists -------------------------------------------------

    def reference(self) -> None:
        """Every case's reference output, on file and announced, before the candidate exists."""
        job = self.job
        try:
            self.make = spec.load(spec.FnSpec.from_dict(job["inputs"]), "inputs")
            self.ref = spec.load(spec.FnSpec.from_dict(job["reference"]), "reference")
            known = job.get("reference_known")  # the evaluator holds these outputs already:
            # only the pre-check's are computed here, and the inputs' hashes announced
            wanted = {c["id"] for c in job["cases"]["correctness"]}
            outputs, t0 = {}, time.monotonic()
            hashes = self._kept_inputs() if known else {}
            for case in job["reference_cases"]:
                args = self.args(case)
                if case["id"] not in hashes:
                    hashes[case["id"]] = values.tree_digest(args)
                if known and case["id"] not in wanted:
                    continue
                arrays: dict[str, Any] = {}  # copied at once: a reused output buffer is fine
                outputs[case["id"]] = (values.flatten(self.ref(*args), arrays, case["id"]),
                                       arrays)
            for case in job["cases"]["identity"][:1]:  # the reference never sees it, but it
                if case["id"] not in hashes:  # is built and kept with the others all the same
                    hashes[case["id"]] = values.tree_digest(self.args(case))
        except BaseException as exc:  # SystemExit too: the request itself is broken
            raise ReferenceFailed(f"{type(exc).__name__}: {exc}") from exc
        self.expected = {c["id"]: outputs[c["id"]] for c in job["cases"]["correctness"]}
        if known:
            _announce(f"{REFERENCE_MARK}{inputs_digest(hashes)}")
            return
        path = os.path.join(job["dir"], "reference")
        values.save(path, {}, outputs)
        values.save(path + ".inputs", {k: v for k, v in self.built.items() if values.plain(v)})
        with open(path + ".meta.json", "w") as f:
            json.dump({"input_hashes": hashes, "seconds": time.monotonic() - t0,
                       "pid": os.getpid()}, f)
        _announce(f"{REFERENCE_MARK}{reference_digest(path)}")

    def _kept_inputs(self) -> dict[str, str]:
        """Cases built by an earlier evaluation, kept by the evaluator: from its sealed
        memfd when that opens here with every seal (nobody can have changed those bytes;
        their index came with the job), else from the files written beside this job, each
        case used only if it hashes to the hash the job carries for it (a file is where a
        candidate could reach it; the hashes came with the job)."""
        sealed = self._sealed_inputs()
        if sealed is not None:
            return sealed
        path, expected = self.job.get("kept_inputs"), self.job.get("input_hashes") or {}
        verified: dict[str, str] = {}
        if not path:
            return verified
        try:
            structures, arrays = values.load(path)
            for case_id, structure in structures.items():
                tree = values.unflatten(structure, arrays)
                if expected.get(case_id) == values.tree_digest(tree):
                    self.built[case_id], verified[case_id] = tree, expected[case_id]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # built here instead
        self.out["inputs_kept"] = len(verified)
        return verified

    def _sealed_inputs(self) -> dict[str, str] | None:
        import fcntl
        import mmap

        sealed, index = self.job.get("kept_sealed"), self.job.get("kept_structures")
        expected = self.job.get("input_hashes") or {}
        if not sealed or not index or not seals():
            return None
        try:
            fd = os.open(sealed["path"], os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # another user's, or gone: the files then
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino, st.st_size) != (sealed["dev"], sealed["ino"],
                                                       sealed["size"]) \
                    or fcntl.fcntl(fd, fcntl.F_GET_SEALS) & seals() != seals():
                self.out["inputs_sealed"] = False  # not that copy, or not sealed
                return None
            # mapped, not read: unflatten's copies are the only ones (the views of the
            # map go with ``arrays``; the map itself when the last of them does)
            structures, arrays = values.loads(
                index.encode(), mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ))
            verified = {}
            for case_id, structure in structures.items():
                if case_id in expected:
                    self.built[case_id] = values.unflatten(structure, arrays)
                    verified[case_id] = expected[case_id]
            arrays.clear()
        except (OSError, ValueError, KeyError, TypeError):
            return None
        finally:
            os.close(fd)
        self.out["inputs_kept"], self.out["inputs_sealed"] = len(verified), True
        return verified

    def prepare(self) -> None:
        job, started = self.job, time.monotonic()
        from krex.measure import make_timer
        from krex.measure.regions import get_region_factory

        self.timer = make_timer(self.device)
        self.region_factory = get_region_factory()
        counters.device_launches()
        self.timer.synchronize()
        self.out["provenance"] = _provenance(self.device, self.timer)
        self.threads = counters.ThreadCpu()
        modules = tuple(getattr(f, "__module__", "") for f in (self.make, self.ref))
        self.trusted = guard.trusted_modules(modules)
        self.fingerprint = guard.guard(self.trusted)
        t0 = time.monotonic()
        self.cand = _call("import", spec.load, spec.FnSpec.from_dict(job["candidate"]),
                          "candidate")
        self.out["stage_s"]["import"] = time.monotonic() - t0
        self.out["stage_s"]["prepare"] = t0 - started

    # -- the stages ------------------------------------------------------------------

    def stages(self) -> None:
        cases = self.job["cases"]
        for name, fn in (("correctness", lambda: self._checked(cases["correctness"])),
                         ("precheck", self._precheck),
                         ("determinism", self._determinism),
                         ("identity", self._identity),
                         ("timing", self._timing),
                         ("held_out", lambda: self._checked(cases["held_out"]))):
            t0 = time.monotonic()
            fn()
            self.out["stage_s"][name] = time.monotonic() - t0

    def _checked(self, cases: list[dict[str, Any]], label: str | None = None) -> None:
        kept = []  # each case's inputs live until the stage ends: equal-sized copies would
        for case in cases:  # reuse a freed address, and an address-keyed cache would then
            # read as a wrong output instead of the identity probe's stale one
            args = self.args(case)
            kept.append(args)
            check = self._mutation_check(case, args)
            result = _call(case["stage"], self.cand, *args)
            self.out["aliases"] += [{**a, "case": case["id"]} for a in values.aliases(result, args)]
            if check():
                self.out["mutated"].append(case["id"])
            self.outputs[label or case["id"]] = result

    def _mutation_check(self, case: dict[str, Any], args: tuple[Any, ...]) -> Callable[[], bool]:
        """Made before the call: after it, whether the call changed ``args``.  Compared
        with the case's pristine build where it can be (exact, at memory speed), else by
        digest taken now."""
        pristine = self.built.get(case["id"])
        if pristine is not None and values.comparable(pristine):  # args: a copy_tree of it
            return lambda: values.unchanged(args, pristine) is not True
        before = values.tree_digest(args)
        return lambda: values.tree_digest(args) != before

    def _precheck(self) -> None:
        """A wrong candidate is not timed: its verdict is invalid whatever the timing says.

        Only a shortcut: the evaluator judges again from the files, so a
        candidate that fools this check is timed and then found out.
        """
        wrong = []
        for case_id, (reference, ref_arrays) in self.expected.items():
            mine: dict[str, Any] = {}
            got = values.flatten(self.outputs[case_id], mine, case_id)
            if values.compare((reference, ref_arrays), (got, mine),
                              self.job.get("atol"), self.job.get("rtol")):
                wrong.append(case_id)
        self.out["precheck_wrong"] = wrong
        self.skip_timing = bool(wrong)

    def _determinism(self) -> None:
        self._checked([self.job["cases"]["correctness"][0]], label="determinism")

    def _identity(self) -> None:
        first, second = self.job["cases"]["identity"]
        args = self.args(first)
        _call("identity", self.cand, *args)
        refilled = values.refill(args, self.args(second))
        self.out["identity_refilled"] = refilled
        if refilled:
            self.outputs["identity"] = _call("identity", self.cand, *args)

    def _timing(self) -> None:
        if self.skip_timing:
            self.out["timing_skipped"] = "outputs already wrong: " + ", ".join(
                self.out["precheck_wrong"])
            return
        job, opts, t0 = self.job, self.job["timing"], time.monotonic()
        rotation = job["cases"]["rotation"]
        a = probe.Calls(self.ref, [self.args(c) for c in rotation], "reference")
        b = probe.Calls(self.cand, [self.args(c) for c in rotation], "candidate")
        mutated = [self._mutation_check(c, args) for c, args in zip(rotation, b.input_sets,
                                                                    strict=True)]
        timer = probe.CountingTimer(self.timer, a, b, self.threads)
        box = probe.ProbeBox()
        stage_s = self.out["stage_s"]

        def run_probe() -> None:  # its own time too: inside the region on a device
            started = time.monotonic()
            try:
                probe.run([a, b], self.timer, self.threads, box)
            finally:
                stage_s["timing:probe:run"] = stage_s.get("timing:probe:run", 0.0) \
                    + time.monotonic() - started

        # Without the interposer (cpu) nothing is queued anywhere to drain: the probe only
        # watches the candidate's threads' CPU time, which others' load does not add to, so
        # it runs after the region instead of lengthening it; else at its end, inside it
        outside = counters.device_launches() is None
        factory = _timed_factory(self.region_factory, self.out["stage_s"])
        if not outside:
            factory = probe.probing_region(factory, run_probe, box)
        from krex.measure import compare
        from krex.measure.clocks import sample

        clocks_before = sample(self.device)
        parts = self.out["stage_s"]
        parts["timing:setup"], t0 = time.monotonic() - t0, time.monotonic()
        try:
            result = compare(a, b, device=self.device, timer=timer, region=factory,
                             label=job.get("label"), retries=1,
                             max_hold_s=opts["timeout_s"] + PROBE_HOLD_S, **opts)
            parts["timing:compare"], t0 = time.monotonic() - t0, time.monotonic()
            if outside and self._no_candidate_thread():
                self.out["probe_skipped"] = (
                    f"no thread of the candidate's was alive at any of the timed loop's "
                    f"{2 * sum(s.samples for s in timer.stats.values())} readings: the "
                    "probe's windows would watch nothing")
            elif outside:
                probe.guarded(run_probe, box)
            parts["timing:probe"], t0 = time.monotonic() - t0, time.monotonic()
        except KrexError as exc:  # the region, not the candidate: no verdict, not a failure
            self.out["timing_error"] = f"{type(exc).__name__}: {exc}"
            return
        except BaseException as exc:  # noqa: BLE001  (the candidate raised while timed)
            raise Stage("timing", exc) from None
        finally:
            timer.close()
            self.out["counters"] = {side: s.to_dict() for side, s in timer.stats.items()}
            self.out["probe"] = [c.to_dict() for c in box.calls]
            self.out["bursts"] = [x.to_dict() for x in box.bursts]
            self.out["probe_error"] = box.error
            pending = [c.pending_ms for c in box.calls] + [b.pending_ms for b in box.bursts]
            if any((p or 0) >= counters.DRAIN_TIMEOUT_S * 1e3 for p in pending):
                _request_recycle("device_work_pending: queued work did not drain")
        self.out["clocks"] = {"before": clocks_before, "after": sample(self.device)}
        self.out["comparison"] = readings.comparison(result)
        self.out["mutated"] += [f"timed/{i}" for i, check in enumerate(mutated) if check()]
        self.out["threads_started"] = max(self.threads.most_alive, len(self.threads.new_threads()))
        self._timed_outputs(b)
        parts["timing:outputs"] = time.monotonic() - t0

    def _no_candidate_thread(self) -> bool:
        """Without the interposer the probe watches only the candidate's threads' CPU time:
        when none was ever alive at a reading (every sample's start and stop read them),
        a call left no thread running after it returned, and the probe has nothing to see."""
        return (self.threads.available and self.threads.most_alive == 0
                and not self.threads.new_threads())

    def _timed_outputs(self, b: probe.Calls) -> None:
        """Call the timed candidate once more on each input set and copy each output at once.

        The candidate is in whatever state the timing left it (an "early return
        once timed" hack still is); copying right away keeps a legitimately
        reused output buffer from reading as the last call's result.
        """
        for slot, args in enumerate(b.input_sets):
            result = _call("timing", self.cand, *args)
            arrays: dict[str, Any] = {}
            self.copies[f"timed/{slot}"] = (values.flatten(result, arrays, f"timed/{slot}"), arrays)

    # -- after ------------------------------------------------------------------------

    def finish(self) -> None:
        if self.fingerprint is not None:
            self.out["tampered"] = self.fingerprint.changed()
            if self.out["tampered"]:
                _request_recycle("krex_tampered: " + ", ".join(self.out["tampered"][:3]))
        try:
            values.save(os.path.join(self.job["dir"], "candidate"), self.outputs, self.copies)
        except Exception as exc:  # noqa: BLE001  (an output krex cannot copy is the candidate's)
            self.out.update({"status": "error", "stage": "outputs",
                             "exception": f"{type(exc).__name__}: {exc}"})


def _timed_factory(inner: Any, parts: dict[str, float]) -> Any:
    """``inner`` with the program's view of each region added to ``parts``: the acquire
    (request to grant, enforcement included), the time inside, the release."""
    import contextlib

    def add(name: str, since: float) -> float:
        now = time.monotonic()
        parts[name] = parts.get(name, 0.0) + now - since
        return now

    @contextlib.contextmanager
    def factory(device: str, **kw: Any) -> Iterator[Any]:
        t0 = time.monotonic()
        ended = [t0]  # when the time inside ended: the release starts there
        try:
            with inner(device, **kw) as region:
                t1 = add("timing:acquire", t0)
                try:
                    yield region
                finally:
                    ended[0] = add("timing:in_region", t1)
        finally:
            if ended[0] != t0:
                t3 = add("timing:release", ended[0])
                _split(parts, getattr(region, "report", None), (t0, t1, ended[0], t3))

    return factory


def _split(parts: dict[str, float], report: Any, marks: tuple[float, ...]) -> None:
    """The acquire and the release split by the daemon's timestamps (the same host's
    CLOCK_MONOTONIC): ``:send`` (from this program's call until the daemon had the
    message), ``:queued`` and ``:enforce`` (the daemon's), ``:deliver`` (from the grant
    sent until this program ran again), ``:undo`` (from the release received until its
    reply reached this program: the daemon's undo, the report, the reply's delivery)."""
    if report is None or report.requested_mono_s is None or report.granted_mono_s is None \
            or report.released_mono_s is None:
        return
    t0, t1, t2, t3 = marks
    queued, enforce = max(0.0, report.waited_s), max(0.0, report.enforce_s)
    split = {"timing:acquire:send": report.requested_mono_s - t0,
             "timing:acquire:queued": queued, "timing:acquire:enforce": enforce,
             "timing:acquire:deliver": t1 - report.granted_mono_s,
             "timing:release:send": report.released_mono_s - t2,
             "timing:release:undo": t3 - report.released_mono_s}
    for name, seconds in split.items():
        parts[name] = parts.get(name, 0.0) + max(0.0, seconds)


SEALS = ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE")


def seals() -> int:
    """The seals a kept copy of the inputs carries (0 where this platform has none)."""
    import fcntl

    return sum(getattr(fcntl, name, 0) for name in SEALS) if hasattr(os, "memfd_create") else 0


def _announce(line: str) -> None:
    """One line on fd 1, unbuffered: it reaches the evaluator before the candidate can run."""
    sys.stdout.flush()
    data = f"\n{line}\n".encode()
    while data:
        data = data[os.write(1, data):]


def _request_recycle(reason: str) -> None:
    try:
        from krex.workers.canary import request_recycle
    except ImportError:
        return
    request_recycle(reason)


def _provenance(device: str, timer: Any) -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(),
                            "timer": timer.name, "device": device}
    for name in ("numpy", "torch"):
        module = sys.modules.get(name)
        if module is not None:
            info[name] = getattr(module, "__version__", "?")
    lib = getattr(getattr(timer, "api", None), "lib", None)
    if lib is not None:
        info.update(_driver(lib))
    return info


def _driver(lib: Any) -> dict[str, Any]:
    import ctypes

    out: dict[str, Any] = {"driver_library": getattr(lib, "_name", None)}
    version = ctypes.c_int()
    fn = getattr(lib, "cuDriverGetVersion", None)
    if fn is not None and fn(ctypes.byref(version)) == 0:
        out["driver_version"] = version.value
    name = ctypes.create_string_buffer(128)
    fn = getattr(lib, "cuDeviceGetName", None)
    if fn is not None and fn(name, 128, 0) == 0:
        out["device_name"] = name.value.decode(errors="replace")
    return out
