"""The sealed call loop alone (krex.evaluate.dispatch, callees, accounting): no daemon.

A callee process is started for a function of tests/evaluate_gallery/cpu/outputs.py,
and the driver's side calls it: outputs cross as JSON and raw bytes (exact types only,
anything else refused by name), the mutation and aliasing flags come from the
dispatcher, the empty call measures the dispatch, a crash is seen, and everything the
callee started is killed with it.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from evaluate_helpers import CPU

from krex.evaluate import values
from krex.evaluate.callees import CalleeFailed, ready, spawn
from krex.evaluate.dispatch import OP_CALL, OP_EMPTY, OP_REFILL, BadOutput, CalleeGone
from krex.evaluate.spec import of

INPUTS = of(os.path.join(CPU, "inputs.py:make"), "inputs").to_dict()
CASES = [{"id": "c0", "seed": 0, "shape": [4, 5], "stage": "correctness"},
         {"id": "c1", "seed": 1, "shape": [4, 5], "stage": "correctness"}]


def make(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((4, 5)).astype(np.float32)


@pytest.fixture
def callee(request):
    started = []

    def start(name: str):
        fn = of(os.path.join(CPU, f"outputs.py:{name}"), "candidate").to_dict()
        c = spawn("candidate", fn, INPUTS, CASES)
        started.append(c)
        ready(c, 60)
        return c

    yield start
    for c in started:
        c.stop()


def test_a_nested_output_crosses_as_json_and_bytes_exactly(callee):
    c = callee("nested")
    record = c.block.call(OP_CALL, 1)
    assert record.status == "ok" and record.span_ns > 0 and not record.aliases
    got = c.block.output("c1")
    x = make(1)
    expected: dict = {}
    want = values.flatten((x * 2, {"a": x[:2] + 1, "b": 3.5, "c": [None, True, 7]},
                           (x * 3).T), expected, "e")
    assert values.compare((want, expected), got) == []
    assert not c.block.mutated()
    assert c.stop() == 0


def test_outputs_that_are_not_exact_buffers_are_refused_by_name(callee):
    for name, type_name in (("lookalike", "ndarray"), ("subclass", "Sub"),
                            ("big_int", "int")):
        c = callee(name)
        assert c.block.call(OP_CALL, 0).status == "bad_output"
        got = c.block.output("c0")
        assert isinstance(got, BadOutput) and type_name in got.type_name, (name, got)
    c = callee("objects")  # numpy exports object arrays' buffers as "O": not a plain dtype
    assert c.block.call(OP_CALL, 0).status == "ok"
    assert isinstance(c.block.output("c0"), BadOutput)


def test_exceptions_mutation_and_aliasing_are_seen_by_the_dispatcher(callee):
    c = callee("raises")
    record = c.block.call(OP_CALL, 0)
    assert record.status == "raised" and "broken on purpose" in record.message
    c = callee("mutate")
    assert c.block.call(OP_CALL, 0).status == "ok" and c.block.mutated()
    out = c.block.output("c0")  # computed on the mutated input, as returned
    assert out[1][out[0]["key"]][0, 0] == 99.0 * 2
    c.block.call(OP_CALL, 0)  # the inputs were restored after the call: mutated again
    assert c.block.mutated()
    c = callee("alias")
    assert c.block.call(OP_CALL, 0).aliases
    c.block.call(OP_REFILL, 0, 1)  # slot 0's objects now hold seed 1's bytes
    c.block.mutated()
    c.block.call(OP_CALL, 0)
    got = c.block.output("x")
    assert np.array_equal(got[1][got[0]["key"]], make(1))


def test_the_empty_call_measures_the_dispatch_and_the_driver_times_the_call(callee):
    c = callee("slow")
    empty = sorted(c.block.call(OP_EMPTY, 0, 1 << 16).span_ns for _ in range(21))
    slow = sorted(c.block.call(OP_CALL, 0).span_ns for _ in range(5))
    assert 0 < empty[10] < 5e6 and slow[2] >= 10e6 > empty[10], (empty, slow)


def test_a_crash_is_seen_and_an_import_failure_named(callee, tmp_path):
    c = callee("segfault")
    with pytest.raises(CalleeGone) as gone:
        c.block.call(OP_CALL, 0, timeout_s=30)
    assert gone.value.exit_code == -11
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no import today')\n")
    c = spawn("candidate", {"path": str(broken), "name": "fn", "sha256": "0" * 64}, INPUTS,
              CASES)
    try:
        with pytest.raises(CalleeFailed) as failed:
            ready(c, 60)
        assert failed.value.stage == "import" and "no import today" in failed.value.text
    finally:
        c.stop()


def test_double_forks_are_counted_and_killed_with_the_callee(callee, tmp_path):
    c = callee("nested")
    if c.accounting is None or c.accounting.path is None:
        pytest.skip(f"no cgroup of its own here: {c.accounting and c.accounting.limitation}")
    before = c.accounting.read()
    pid = os.fork()
    if pid == 0:  # stands in for the candidate's double fork: a process joining its cgroup
        try:
            with open(os.path.join(c.accounting.path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            if os.fork() == 0:
                os.setsid()
                end = time.monotonic() + 5
                while time.monotonic() < end:
                    pass
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(0.3)
    after = c.accounting.read()
    assert after.processes == 2 and after.candidates_ns - before.candidates_ns > 100e6
    path = c.accounting.path
    c.stop()
    assert not os.path.exists(path)  # empty, removed: the spinner was killed with it


class _Runs:
    """Unpickling this would call os.system: the summary's decoder must never do it."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/krex-test-pwned",))


def test_the_summary_is_decoded_without_looking_up_any_global():
    import pickle

    from krex.evaluate.evidence import summary as _summary
    from krex.workers.spec import ExecResult

    text = ExecResult("ok", 0, value=pickle.dumps('{"status": "ok", "pid": 7}'))
    assert _summary(text) == {"status": "ok", "pid": 7}  # the sealed driver's JSON text
    plain = ExecResult("ok", 0, value=pickle.dumps({"status": "ok", "n": [1, 2.5]}))
    assert _summary(plain) == {"status": "ok", "n": [1, 2.5]}
    hostile = ExecResult("ok", 0, value=pickle.dumps({"status": "ok", "x": _Runs()}))
    refused = _summary(hostile)
    assert refused["status"] == "error" and "refused" in refused["exception"]
    assert not os.path.exists("/tmp/krex-test-pwned")


def test_candidate_files_changed_after_the_driver_wrote_them_are_tampered(tmp_path):
    from krex.evaluate.evidence import candidate_tree, files_digest

    path = str(tmp_path / "candidate")
    values.save(path, {"c0": np.arange(1.0, 5.0)})
    digest = files_digest(path)
    tree, finding = candidate_tree(path, {"candidate_sha256": digest}, values.load)
    assert finding is None and tree is not None
    with open(path + ".bin", "r+b") as f:
        f.write(b"\0" * 8)
    tree, finding = candidate_tree(path, {"candidate_sha256": digest}, values.load)
    assert tree is None and finding is not None and finding.code.name == "KREX_TAMPERED"


def test_cgroups_of_callees_that_are_gone_are_swept():
    """A driver killed mid-evaluation (its worker's timeout) leaves its callee's empty
    cgroup behind: the next evaluation's accounting removes it, never a live pid's."""
    from krex.evaluate import accounting

    root = accounting._cpuacct_root()
    if root is None:
        pytest.skip("no cpuacct hierarchy")
    parent = os.path.join(root, accounting._own_cpuacct().lstrip("/"))
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a pid that is gone
    stale = os.path.join(parent, f"krex-callee-{pid}-abcdef")
    mine = os.path.join(parent, f"krex-callee-{os.getpid()}-abcdef")  # a live pid's: kept
    try:
        os.mkdir(stale)
        os.mkdir(mine)
    except OSError as exc:
        pytest.skip(f"cpuacct not writable here: {exc}")
    try:
        assert f"krex-callee-{pid}-abcdef" in accounting.sweep(parent)
        assert not os.path.exists(stale) and os.path.exists(mine)
    finally:
        os.rmdir(mine)
        if os.path.exists(stale):
            os.rmdir(stale)
