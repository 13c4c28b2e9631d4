"""KernelBench problems through ``krex evaluate --kernelbench`` (issue 46), and torch
functions through ``krex.evaluate``, on ``cpu``.

The examples in examples/kernelbench/ through the real CLI, a real daemon and the
sealed evaluation: a solution computes with the problem's weights where it keeps the
problem's layer names (its control: the same solution with the layer renamed is
wrong).  The cached answer and the solution that does not load are
tests/test_kernelbench_run.py's (a folder through ``krex kernelbench run``).  Only
verdicts of correctness and integrity are asserted (no speed): the module runs in the
suite's parallel phase, on one daemon.
"""

from __future__ import annotations

import json
import os

import pytest
from evaluate_helpers import module_daemon
from helpers import run_krex

import krex

pytest.importorskip("torch", reason="torch is optional (pip install torch==2.13.0)")
pytestmark = pytest.mark.slow

TORCH_GALLERY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "evaluate_gallery",
                             "torch_cpu")
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                    "kernelbench")


def _evaluate(daemon, tmp_path, problem: str, solution: str) -> dict:
    proc = run_krex("evaluate", "--kernelbench", os.path.join(HERE, "problems", problem),
                    "--cand", os.path.join(HERE, "solutions", solution), "--device", "cpu",
                    "--seeds", "2", "--cache", "hot", "--records",
                    str(tmp_path / "records.sqlite3"), "--json",
                    env={**os.environ, "KREX_SOCKET": daemon.socket,
                         "XDG_CACHE_HOME": str(tmp_path / "cache")}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _codes(ev: dict) -> list[str]:
    return [f["code"] for f in ev["findings"]]


def test_a_solution_keeps_the_problems_weights_under_the_problems_names(daemon_m, tmp_path):
    """Both solutions draw a probe vector before their layer, so their own weights are
    not the problem's: the one that names its layer as the problem does gets the
    problem's (correct); the one that renames it keeps its own (wrong: the control)."""
    same = _evaluate(daemon_m, tmp_path, "2_Linear_ReLU.py", "2_Linear_ReLU_fused.py")
    assert same["correct"] and same["verdict"] != "invalid", _codes(same)
    renamed = _evaluate(daemon_m, tmp_path, "2_Linear_ReLU.py", "2_Linear_ReLU_renamed.py")
    assert not renamed["correct"] and renamed["verdict"] == "invalid", _codes(renamed)
    assert "WRONG_OUTPUT" in _codes(renamed), _codes(renamed)


def test_a_problem_without_the_format_is_refused_with_what_it_lacks(tmp_path):
    bad = tmp_path / "p.py"
    bad.write_text("def get_inputs():\n    return []\n")
    proc = run_krex("evaluate", "--kernelbench", str(bad), "--cand",
                    os.path.join(HERE, "solutions", "1_Softplus_fused.py"), timeout=60)
    assert proc.returncode != 0
    assert "defines no Model" in proc.stderr, proc.stderr
    both = run_krex("evaluate", "--kernelbench", str(bad), "--ref", "x.py:f", "--cand",
                    os.path.join(HERE, "solutions", "1_Softplus_fused.py"), timeout=60)
    assert both.returncode != 0 and "takes the place of --ref" in both.stderr, both.stderr
    shaped = run_krex("evaluate", "--kernelbench", str(bad), "--shapes", "[[4]]", "--cand",
                      os.path.join(HERE, "solutions", "1_Softplus_fused.py"), timeout=60)
    assert shaped.returncode != 0 and "--shapes does not apply" in shaped.stderr, shaped.stderr


# -- krex.evaluate on torch functions (the path KernelBench pairs take) ------------------

def test_torch_tensors_and_nested_outputs(tmp_path_factory):
    """krex.evaluate on torch functions, in workers that preload torch (it cannot be
    imported twice in one process)."""
    for _daemon in module_daemon(tmp_path_factory, "--preload", "numpy,torch"):
        _torch_checks(TORCH_GALLERY)


def _torch_checks(folder: str) -> None:
    good = krex.evaluate(f"{folder}/kernels.py:reference", f"{folder}/kernels.py:candidate",
                         f"{folder}/kernels.py:make", cache="hot", fresh=True, save=False)
    assert good.correct and good.verdict != "invalid", good.summary()
    assert good.provenance.get("torch")
    # Tensor inputs are refilled and checked as arrays are: without it (the dispatcher
    # took only numpy's buffers) the honest candidate above read STALE_OUTPUT, and a
    # scribbled input went unseen (a cached answer: tests/test_kernelbench.py).
    caught = krex.evaluate(f"{folder}/kernels.py:reference", f"{folder}/kernels.py:scribbles",
                           f"{folder}/kernels.py:make", cache="hot", fresh=True, save=False)
    assert "INPUT_MUTATED" in caught.codes() and caught.verdict == "invalid", caught.summary()


def test_a_kernelbench_pair_through_the_service(service):
    """``POST /v1/jobs/evaluate`` with ``problem`` and ``solution`` in place of the three
    functions: a node path or the file's text, the generated modules in the job's folder.
    The cached solution sent as text is ``STALE_OUTPUT``; its control, the fused one by
    path, is correct with no such finding.  A body mixing both forms, or giving shapes
    with a pair, is refused before it runs."""
    problem = os.path.join(HERE, "problems", "1_Softplus.py")
    with open(os.path.join(HERE, "solutions", "1_Softplus_cached.py")) as f:
        cached = {"source": f.read()}
    jobs = {}
    for name, solution in (("fused", os.path.join(HERE, "solutions", "1_Softplus_fused.py")),
                           ("cached", cached)):
        status, jobs[name] = service.call("POST", "/v1/jobs/evaluate", {
            "problem": problem, "solution": solution, "seeds": 2, "cache": "hot"})
        assert status == 201, jobs[name]
    fused, cheat = (_done(service, jobs[name]["id"]) for name in ("fused", "cached"))
    assert fused["state"] == "succeeded" and fused["result"]["correct"] is True, fused
    assert "STALE_OUTPUT" not in {f["code"] for f in fused["result"]["findings"]}, fused
    assert cheat["result"]["verdict"] == "invalid", cheat
    assert "STALE_OUTPUT" in {f["code"] for f in cheat["result"]["findings"]}, cheat
    for bad in ({"problem": problem, "solution": cached, "inputs": "/x.py:make"},
                {"problem": problem, "solution": cached, "shapes": [[4]]}):
        status, refused = service.call("POST", "/v1/jobs/evaluate", bad)
        assert status == 422, refused


def _done(service, job_id: str) -> dict:
    """The job once it is done (long polls of at most the service's 60 s)."""
    for _ in range(4):
        job = service.wait(job_id, wait_s=60, timeout=90)
        if job["state"] not in ("queued", "running"):
            return job
    raise AssertionError(f"job {job_id} not done in 4 minutes: {job}")
