"""``krex kernelbench run`` on a folder: every solution a verdict, resumed, nothing left.

Through the real CLI and a real daemon on ``cpu``: a folder with a correct solution,
a cheat (a cached answer), one that does not load, one that hangs and one that
kills its own process finishes with exit 0 and a verdict for each -- the cheat
``STALE_OUTPUT``, the hang ``TIMEOUT`` past ``--timeout-s``, the crash and the
broken one ``invalid`` with what happened -- in results.jsonl and results.csv; a
file that names no problem is reported, not evaluated.  Run again, it evaluates
nothing (resumed); the solution edited, it evaluates that one again.  The suite's
leak check fails the test if a worker or a callee is left running.
"""

from __future__ import annotations

import csv
import json
import os
import shutil

import pytest
from helpers import run_krex

pytest.importorskip("torch", reason="torch is optional (pip install torch==2.13.0)")
pytestmark = pytest.mark.slow

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "kernelbench")
SOFTPLUS = '''
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        {body}
        return torch.nn.functional.softplus(x)
'''




def _folder(tmp_path) -> tuple[str, str]:
    problems, solutions = tmp_path / "problems", tmp_path / "solutions"
    problems.mkdir()
    solutions.mkdir()
    for name in ("1_Softplus.py", "2_Linear_ReLU.py"):
        shutil.copy(os.path.join(EXAMPLES, "problems", name), problems)
    for name in ("1_Softplus_fused.py", "1_Softplus_cached.py", "2_Linear_ReLU_broken.py"):
        shutil.copy(os.path.join(EXAMPLES, "solutions", name), solutions)
    (solutions / "1_Softplus_hang.py").write_text(SOFTPLUS.format(
        body="import time; time.sleep(3600)"))
    (solutions / "1_Softplus_crash.py").write_text(SOFTPLUS.format(
        body="import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    (solutions / "notes.py").write_text("# not a solution of any problem here\n")
    return str(problems), str(solutions)


def _run(daemon, tmp_path, problems: str, solutions: str):
    return run_krex("kernelbench", "run", "--problems", problems, "--solutions", solutions,
                    "--out", str(tmp_path / "out"), "--jobs", "3", "--seeds", "2",
                    "--cache", "hot", "--timeout-s", "30", "--records",
                    str(tmp_path / "records.sqlite3"), "--json",
                    env={**os.environ, "KREX_SOCKET": daemon.socket,
                         "XDG_CACHE_HOME": str(tmp_path / "cache")}, timeout=400)


def test_a_folder_with_a_cheat_a_hang_and_a_crash_gets_a_verdict_for_each(daemon_m,
                                                                            tmp_path):
    problems, solutions = _folder(tmp_path)
    proc = _run(daemon_m, tmp_path, problems, solutions)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    seen = {o["solution"]: o for o in out["outcomes"]}
    assert set(seen) == {"1_Softplus_fused.py", "1_Softplus_cached.py",
                         "2_Linear_ReLU_broken.py", "1_Softplus_hang.py",
                         "1_Softplus_crash.py"}, seen
    assert out["unmatched"] == [{"solution": "notes.py", "why": out["unmatched"][0]["why"]}]
    fused = seen["1_Softplus_fused.py"]
    assert fused["correct"] is True and fused["verdict"] != "invalid", fused
    assert fused["problem"] == "1_Softplus.py" and fused["record_id"], fused
    cached = seen["1_Softplus_cached.py"]
    assert cached["verdict"] == "invalid" and "STALE_OUTPUT" in cached["findings"], cached
    for name in ("2_Linear_ReLU_broken.py", "1_Softplus_hang.py", "1_Softplus_crash.py"):
        assert seen[name]["verdict"] == "invalid" and seen[name]["correct"] is False, \
            seen[name]
    assert seen["1_Softplus_hang.py"]["status"] == "timeout", seen["1_Softplus_hang.py"]
    assert seen["1_Softplus_crash.py"]["status"] == "crashed", seen["1_Softplus_crash.py"]
    assert out["evaluated"] == 5 and out["resumed"] == 0 and out["errors"] == 0, out
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(ln)["solution"] for ln in lines) == sorted(seen)
    with open(tmp_path / "out" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["solution"]: r["verdict"] for r in rows} == \
        {k: v["verdict"] for k, v in seen.items()}
    # resumed: nothing again; an edited solution again (its control)
    again = json.loads(_run(daemon_m, tmp_path, problems, solutions).stdout)
    assert again["evaluated"] == 0 and again["resumed"] == 5, again
    fused_path = os.path.join(solutions, "1_Softplus_fused.py")
    with open(fused_path, "a") as f:
        f.write("\n# edited\n")
    edited = json.loads(_run(daemon_m, tmp_path, problems, solutions).stdout)
    assert edited["evaluated"] == 1 and edited["resumed"] == 4, edited
