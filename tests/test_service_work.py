"""What a job's processes start with: a minimal environment, nothing from a writable cwd.

Through a real ``krex service`` and daemon: an exec job does not see a variable of
the service's own environment (a secret of the service's user), only the
documented minimal set (``krex.workers.launcher.JOB_ENV``) and what its request's
``env`` adds; an evaluation's or a bench's process (``krex.service.child``,
started in the service's state directory, which tenant code can write) imports
nothing planted there.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import PY

pytest.importorskip("fastapi", reason="the `server` extra is not installed")
from service_support import Service


def test_an_exec_job_gets_a_minimal_environment(daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("SERVICE_SECRET", "hunter2")  # the service inherits it
    s = Service(tmp_path / "state", "--runners", "1")
    try:
        prog = "import json, os\nprint(json.dumps(dict(os.environ)))\n"
        _, job = s.call("POST", "/v1/jobs/exec", {"program": prog, "env": {"MINE": "1"}})
        done = s.wait(job["id"])
        assert done["state"] == "succeeded", done
        env = json.loads(done["result"]["stdout"])
    finally:
        s.stop()
    assert "SERVICE_SECRET" not in env and "hunter2" not in json.dumps(env), env
    # Negative controls: what the request adds, and what a program needs, are there.
    assert env["MINE"] == "1"
    assert env.get("PATH") and env.get("HOME") == os.environ["HOME"], env
    assert env.get("KREX_SOCKET"), env  # krex's own runtime variables (the worker's)


def test_a_jobs_process_imports_nothing_planted_in_the_state_directory(daemon, tmp_path):
    state, marker = tmp_path / "state", tmp_path / "imported"
    state.mkdir()
    (state / "json.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                   "raise ImportError('planted')\n")
    subprocess.run([PY, "-c", "import json"], cwd=state, capture_output=True, timeout=60)
    assert marker.exists()  # the trap works: a plain run there imports it
    marker.unlink()
    s = Service(state, "--runners", "1")
    try:
        _, job = s.call("POST", "/v1/jobs/bench", {"command": "true", "runs": 1, "warmup": 0})
        done = s.wait(job["id"], wait_s=60)
        assert done["state"] == "succeeded", done  # control: the job itself works
    finally:
        s.stop()
    assert not marker.exists(), "a job's process imported a module from the state directory"
