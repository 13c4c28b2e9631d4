"""The reference's outputs computed once per reference, not per candidate (references).

Through a real daemon: a second evaluation of the same reference and inputs
builder uses the outputs the evaluating process kept (and its worker never
calls the reference beyond the pre-check's cases); a changed reference or
inputs builder, or other cases, miss; a candidate cannot poison the entry
(rewriting the files on a miss is caught by the announced digest and nothing
is kept; on a hit it finds no files the evaluator reads); an entry whose
bytes changed is dropped on use; a worker that builds other inputs than the
entry was made from makes the evaluation run again without it.  All with
``isolation="worker"``: a sealed evaluation (``"process"``) keeps nothing
(test_a_sealed_evaluation_keeps_nothing).
"""

from __future__ import annotations

import os

import pytest
from evaluate_helpers import CPU, spec, verdict_or_abstained

import krex
from krex.evaluate import pipeline, references
from krex.evaluate.references import REFERENCES

pytestmark = pytest.mark.slow

REF, INPUTS = spec(CPU, "kernels.py:reference"), spec(CPU, "inputs.py:make")


@pytest.fixture(autouse=True)
def empty_cache():
    REFERENCES.clear()
    yield
    REFERENCES.clear()


def evaluate(cand: str, ref: str = REF, inputs: str = INPUTS, **kw):
    kw.setdefault("cache", "hot")
    kw.setdefault("max_time_s", 0.3)
    kw.setdefault("isolation", "worker")  # the cache serves one-program evaluations only: with
    # isolation="process" (cpu's default) the reference runs in a process of its own each time
    return krex.evaluate(ref, cand, inputs, fresh=True, save=False, **kw)


def cached(ev) -> bool:
    return ev.provenance["reference_cached"]


def test_the_second_evaluation_uses_the_kept_outputs_and_judges_the_same(daemon_m):
    first = evaluate(spec(CPU, "honest.py:faster"))
    assert not cached(first) and verdict_or_abstained(first, "faster"), first.summary()
    second = evaluate(spec(CPU, "honest.py:faster"))
    assert cached(second) and verdict_or_abstained(second, "faster"), second.summary()
    assert second.provenance["input_hashes"] == first.provenance["input_hashes"]
    # the worker took every case's inputs from the kept files instead of building them,
    # the identity probe's first case (which the reference never sees) included
    assert second.integrity["inputs_kept"] == len(first.provenance["input_hashes"]) > 5
    assert "i0" in first.provenance["input_hashes"]
    if references.seals():  # Linux: read from the evaluator's sealed memfd, not hashed
        assert second.integrity["inputs_sealed"] is True, second.integrity
    assert "inputs_kept" not in first.integrity
    wrong = evaluate(spec(CPU, "hacks.py:zeros_only"))  # judged against the kept outputs
    assert cached(wrong) and "WRONG_OUTPUT" in wrong.codes() and wrong.verdict == "invalid"


def test_a_changed_reference_or_inputs_builder_or_other_cases_miss(daemon_m, tmp_path):
    evaluate(spec(CPU, "honest.py:same"))
    assert cached(evaluate(spec(CPU, "honest.py:same")))
    ref = tmp_path / "ref.py"  # same function, other file contents: another code hash
    ref.write_text(f"import sys\nsys.path.insert(0, {CPU!r})\nfrom kernels import work\n\n\n"
                   "def reference(x):\n    return work(x, 2)\n")
    assert not cached(evaluate(spec(CPU, "honest.py:same"), ref=f"{ref}:reference"))
    inputs = tmp_path / "inputs.py"
    inputs.write_text("import numpy as np\n\nSHAPES = [(256, 512), (96, 200)]\n\n\n"
                      "def make(seed, shape=(256, 512)):\n"
                      "    return (np.random.default_rng(seed + 7).standard_normal(shape)"
                      ".astype(np.float32),)\n")
    ev = evaluate(spec(CPU, "honest.py:same"), inputs=f"{inputs}:make")
    assert not cached(ev) and ev.options["shapes"] == [[256, 512], [96, 200]]
    assert not cached(evaluate(spec(CPU, "honest.py:same"), seeds=2))  # other cases
    assert cached(evaluate(spec(CPU, "honest.py:same")))  # the first entry is still there


def test_the_key_names_code_cases_and_device():
    ref = {"path": "/a/ref.py", "function": "fn", "sha256": "1"}
    inputs = {"path": "/a/inputs.py", "function": "make", "sha256": "2"}
    cases = [{"id": "c0", "seed": 0, "shape": [4, 4]}]
    base = references.key(ref, inputs, cases, "cpu")
    assert base == references.key(dict(ref), dict(inputs), [dict(cases[0])], "cpu")
    assert base != references.key({**ref, "sha256": "3"}, inputs, cases, "cpu")
    assert base != references.key(ref, {**inputs, "sha256": "3"}, cases, "cpu")
    assert base != references.key(ref, inputs, [{**cases[0], "seed": 1}], "cpu")
    assert base != references.key(ref, inputs, [{**cases[0], "shape": [4, 5]}], "cpu")
    assert base != references.key(ref, inputs, cases, "fakegpu:0")


def test_a_candidate_cannot_poison_the_kept_outputs(daemon_m):
    poison = spec(CPU, "rewrite_reference.py:fn")
    ev = evaluate(poison)  # a miss: the files are rewritten after the announcement
    assert "KREX_TAMPERED" in ev.codes() and ev.verdict == "invalid", ev.summary()
    assert not cached(ev)
    honest = evaluate(spec(CPU, "honest.py:faster"))  # nothing was kept from the poisoned run
    assert not cached(honest) and verdict_or_abstained(honest, "faster"), honest.summary()
    ev = evaluate(poison)  # a hit: zeros planted where no one reads them, the pre-check fooled
    assert cached(ev), ev.summary()
    assert "WRONG_OUTPUT" in ev.codes() and ev.verdict == "invalid", ev.summary()
    again = evaluate(spec(CPU, "honest.py:faster"))
    assert cached(again) and verdict_or_abstained(again, "faster") and again.correct, \
        again.summary()


def test_an_entry_whose_bytes_changed_is_dropped_on_use(daemon_m):
    evaluate(spec(CPU, "honest.py:faster"))
    (k, entry), = REFERENCES._entries.items()
    entry.blobs = (entry.blobs[0].replace(b"float32", b"float64"), *entry.blobs[1:])
    assert REFERENCES.get(k) is None and not REFERENCES._entries
    assert not cached(evaluate(spec(CPU, "honest.py:faster")))


def test_inputs_that_differ_from_the_entry_run_the_evaluation_again(daemon_m, monkeypatch):
    evaluate(spec(CPU, "honest.py:faster"))
    (k, entry), = REFERENCES._entries.items()
    entry.inputs = "0" * 64  # as if this worker's builder made other inputs
    runs = []
    real = pipeline._run
    monkeypatch.setattr(pipeline, "_run", lambda *a, **kw: runs.append(kw) or real(*a, **kw))
    ev = evaluate(spec(CPU, "honest.py:faster"))
    assert not cached(ev) and verdict_or_abstained(ev, "faster"), ev.summary()
    assert runs == [{}, {"use_cache": False}]


def test_kept_inputs_that_do_not_hash_as_built_are_built_again(daemon_m, monkeypatch):
    """Without the sealed copy the kept inputs reach the worker as files a candidate could
    rewrite: each case is used only if it hashes to the hash the job carries; else it is
    built as before."""
    monkeypatch.setattr(references.Entry, "sealed_inputs", lambda self: None)
    evaluate(spec(CPU, "honest.py:faster"))
    real = references.Entry.write_inputs

    def tampered(self, path):
        written = real(self, path)
        with open(written + ".bin", "r+b") as f:
            f.write(bytes(4096))  # the first case's first 1024 floats turned to zeros
        return written

    monkeypatch.setattr(references.Entry, "write_inputs", tampered)
    ev = evaluate(spec(CPU, "honest.py:faster"))
    assert cached(ev) and verdict_or_abstained(ev, "faster") and ev.correct, ev.summary()
    n = len(ev.provenance["input_hashes"])
    assert ev.integrity["inputs_kept"] == n - 1  # one case rebuilt, the others taken
    monkeypatch.setattr(references.Entry, "write_inputs", real)
    # the kept copy is shared by hard links: the rewrite above reached it, so this use
    # found a case changed and the next one gets a fresh copy (without that: n - 1 again)
    ev = evaluate(spec(CPU, "honest.py:faster"))
    assert ev.integrity["inputs_kept"] == n, ev.integrity
    monkeypatch.setattr(references.Entry, "write_inputs", lambda self, path: path + "-gone")
    ev = evaluate(spec(CPU, "honest.py:faster"))
    assert ev.integrity["inputs_kept"] == 0 and verdict_or_abstained(ev, "faster"), ev.summary()


@pytest.mark.skipif(not references.seals(), reason="no sealed memfds on this platform")
def test_only_a_sealed_copy_of_the_kept_inputs_is_read_unhashed(daemon_m, monkeypatch):
    """The worker reads the kept inputs unhashed only from the memfd the job names, with
    every seal and the inode and size the job carries; an unsealed descriptor holding
    zeros, or another inode, is refused (``inputs_sealed`` false) and the hashed files
    serve instead: the verdict stands and nothing is built from the zeros."""
    import fcntl

    evaluate(spec(CPU, "honest.py:faster"))
    real = references.Entry.sealed_inputs
    unsealed = os.memfd_create("not-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        def zeros(self):
            where = real(self)
            os.ftruncate(unsealed, where["size"])  # zeros, writable, no seals
            st = os.fstat(unsealed)
            return {**where, "path": f"/proc/{os.getpid()}/fd/{unsealed}",
                    "dev": st.st_dev, "ino": st.st_ino}

        for forged in (zeros, lambda self: {**real(self), "ino": 1}):
            monkeypatch.setattr(references.Entry, "sealed_inputs", forged)
            ev = evaluate(spec(CPU, "honest.py:faster"))
            n = len(ev.provenance["input_hashes"])
            assert ev.integrity["inputs_sealed"] is False, ev.integrity
            assert ev.integrity["inputs_kept"] == n  # from the hashed files instead
            assert verdict_or_abstained(ev, "faster") and ev.correct, ev.summary()
        assert fcntl.fcntl(unsealed, fcntl.F_GET_SEALS) == 0  # the control was unsealed
    finally:
        os.close(unsealed)


def test_a_sealed_evaluation_keeps_nothing(daemon_m):
    """The reference of a sealed evaluation runs in a process of its own each time: no
    entry is made or used (its outputs never pass through the candidate's process)."""
    first = evaluate(spec(CPU, "honest.py:faster"), isolation="process")
    second = evaluate(spec(CPU, "honest.py:faster"), isolation="process")
    assert not cached(first) and not cached(second)
    assert second.integrity["isolation"] == "process" and second.correct, second.summary()
