"""A service's jobs database stays within ``--jobs-max-mb`` whatever its tenants' jobs
print (issue 44, byte budgets), through a real service: the unit-level control (the same
filling without a budget grows past it) is in test_service_memory.py."""

from __future__ import annotations

import os

import pytest
from service_support import Service

pytest.importorskip("fastapi", reason="the `server` extra is not installed")
pytestmark = pytest.mark.timeout(120)

PRINT = "import sys; sys.stdout.write('x' * int(sys.argv[1]))"


def test_jobs_that_print_a_lot_leave_the_database_within_its_budget(daemon, tmp_path):
    state = tmp_path / "state"
    s = Service(state, "--runners", "2", "--jobs-max-mb", "0.25")
    try:
        ids = []
        for _ in range(12):  # 12 x 60 KB of output tails: 720 KB against 256 KB
            status, job = s.call("POST", "/v1/jobs/exec", {"program": PRINT, "args": ["60000"],
                                                            "device": "cpu"})
            assert status in (200, 201, 202), job
            ids.append(job["id"])
        done = [s.wait(i, wait_s=60) for i in ids]
        assert all(j["state"] == "succeeded" for j in done), [j["error"] for j in done]
        assert len(done[-1]["result"]["stdout"]) >= 60000 * 0.9  # the outputs were kept
        status, body = s.call("GET", f"/v1/jobs/{ids[0]}")
        assert status == 404, "the oldest finished job was pruned for the budget"
    finally:
        s.stop()
    size = os.path.getsize(state / "jobs.sqlite3")
    assert size <= 0.25 * 2**20 * 1.5, size


def test_records_past_their_budget_are_pruned_after_an_evaluation(daemon, tmp_path):
    """``--records-max-mb``: after each evaluation job the records database's oldest
    evaluations go once its pages in use pass the budget (here one smaller than any
    record: none stays).  Control: the same service without the flag keeps it."""
    from evaluate_helpers import CPU, spec

    body = {"reference": spec(CPU, "kernels.py:reference"),
            "candidate": spec(CPU, "honest.py:faster"), "inputs": spec(CPU, "inputs.py:make"),
            "cache": "hot", "seeds": 2, "fresh": True}

    def evaluate_once(*flags: str) -> int:
        state = tmp_path / ("budget" if flags else "plain")
        s = Service(state, *flags)
        try:
            status, job = s.call("POST", "/v1/jobs/evaluate", body)
            assert status in (200, 201, 202), job
            done = s.wait(job["id"], wait_s=60)
            assert done["state"] == "succeeded", done
            status, records = s.call("GET", "/v1/records")
            assert status == 200, records
            return len(records["records"])
        finally:
            s.stop()

    assert evaluate_once("--records-max-mb", "0.001") == 0
    assert evaluate_once() == 1
