"""Cancelling a running evaluation or bench job through a real ``krex service``.

A running job's process is killed with the warm worker running its program and
every command it started; the job ends ``cancelled`` within a bound taken from
the service's own round trips, nothing of it is left running or stopped, the
device is free at once (a region is granted right after), no record is
written, and a retried cancel changes nothing.  Negative control: the same job,
not cancelled, finishes with its verdict.
"""

from __future__ import annotations

import glob
import os
import statistics
import tempfile
import time

import psutil
import pytest
from evaluate_helpers import CPU, spec
from helpers import run_krex, wait_for
from service_support import Service

pytest.importorskip("fastapi", reason="the `server` extra is not installed")


def _round_trips(s: Service, n: int = 5) -> list[float]:
    """Seconds from submit to done of a trivial job: the service's own pace now."""
    out = []
    for _ in range(n):
        t = time.monotonic()
        _, job = s.call("POST", "/v1/jobs/exec", {"program": "pass\n"})
        assert s.wait(job["id"])["state"] == "succeeded"
        out.append(time.monotonic() - t)
    return out


def _bound_s(trips: list[float]) -> float:
    """A cancel may take a few round trips (find, stop, kill, reap), never the job's run."""
    return 6 * (statistics.median(trips) + statistics.pstdev(trips)) + 1.0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _cancel_twice(s: Service, job_id: str) -> tuple[dict, float]:
    t = time.monotonic()
    status, marked = s.call("POST", f"/v1/jobs/{job_id}/cancel")
    assert status == 200 and marked["cancel_requested"], marked
    ended = s.wait(job_id, wait_s=60)
    took = time.monotonic() - t
    status, again = s.call("POST", f"/v1/jobs/{job_id}/cancel")  # idempotent
    assert status == 200 and again["state"] == "cancelled", again
    assert again["ended_s"] == ended["ended_s"] and again["error"] == ended["error"]
    return ended, took


def _region_granted_now() -> float:
    t = time.monotonic()
    out = run_krex("region", "--label", "after-cancel", "--", "true", timeout=60)
    assert out.returncode == 0, out.stderr
    return time.monotonic() - t


def _waiting(pidfile, flag) -> str:
    return (f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
            f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.02)\n")


def test_cancel_a_running_bench_kills_its_command_and_frees_the_device(service, tmp_path):
    trips = _round_trips(service)
    free_s = _region_granted_now()

    def body(name: str) -> dict:
        pid, flag = tmp_path / f"{name}.pid", tmp_path / f"{name}.go"
        script = (f"echo $$ > {pid}; while [ ! -e {flag} ]; do sleep 0.02; done")
        return {"command": script, "runs": 1, "warmup": 0}

    _, job = service.call("POST", "/v1/jobs/bench", body("cancelled"))
    pidfile = tmp_path / "cancelled.pid"
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout_s=60)
    command = int(pidfile.read_text())  # the timed run, inside the job's region
    ended, took = _cancel_twice(service, job["id"])
    assert ended["state"] == "cancelled" and ended["result"] is None, ended
    assert took < _bound_s(trips), (took, trips)
    wait_for(lambda: _gone(command), timeout_s=_bound_s(trips))  # nothing left running
    assert _region_granted_now() < 10 * free_s + 5.0  # the job's region ended with it
    # Negative control: the same job, not cancelled, finishes with its timing.
    _, control = service.call("POST", "/v1/jobs/bench", body("control"))
    wait_for(lambda: (tmp_path / "control.pid").exists(), timeout_s=60)
    (tmp_path / "control.go").touch()
    done = service.wait(control["id"], wait_s=60)
    assert done["state"] == "succeeded" and done["result"]["runs"] == 1, done
    assert done["result"]["region_id"] is not None


def _records(s: Service) -> set[str]:
    status, rows = s.call("GET", "/v1/records?limit=100")
    assert status == 200, rows
    return {r["id"] for r in rows["records"]}


@pytest.mark.serial  # compares the machine's krex-evaluate-* scratch dirs before and after
def test_cancel_a_running_evaluation_kills_its_program_and_records_nothing(service, tmp_path):
    trips = _round_trips(service)

    def body(name: str) -> dict:
        cand = (_waiting(tmp_path / f"{name}.pid", tmp_path / f"{name}.go")
                + "import numpy as np\n\n\ndef fast(x):\n"
                  "    return x * np.sqrt(x * x + np.float32(1.0))\n")
        return {"reference": spec(CPU, "kernels.py:reference"),
                "candidate": {"source": cand, "function": "fast"},
                "inputs": spec(CPU, "inputs.py:make"), "cache": "hot", "seeds": 2}

    before = _records(service)
    scratch = set(glob.glob(os.path.join(tempfile.gettempdir(), "krex-evaluate-*")))
    _, job = service.call("POST", "/v1/jobs/evaluate", body("cancelled"))
    pidfile = tmp_path / "cancelled.pid"
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout_s=60)
    worker = int(pidfile.read_text())  # the warm worker running the evaluation's program
    assert worker != os.getpid()
    ended, took = _cancel_twice(service, job["id"])
    assert ended["state"] == "cancelled" and ended["result"] is None, ended
    assert ended["error"]["code"] == "job_stopped", ended
    assert took < _bound_s(trips), (took, trips)
    wait_for(lambda: _gone(worker), timeout_s=_bound_s(trips))  # killed, to be replaced
    assert _records(service) == before  # nothing recorded as if it had finished
    _region_granted_now()
    # Negative control: the same evaluation, not cancelled, ends with its verdict and record.
    _, control = service.call("POST", "/v1/jobs/evaluate", body("control"))
    wait_for(lambda: (tmp_path / "control.pid").exists(), timeout_s=60)
    (tmp_path / "control.go").touch()
    done = service.wait(control["id"], wait_s=60)
    assert done["state"] == "succeeded", done
    assert done["result"]["correct"] is True and done["result"]["verdict"], done
    assert _records(service) == before | {done["result"]["record_id"]}
    # neither left its working directory behind (the killed one's went with its job folder)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "krex-evaluate-*"))) == scratch


def test_mcp_client_cancelling_a_bench_call_stops_its_command(daemon, tmp_path):
    """An MCP client that cancels its ``bench_command`` call (the SDK sends
    ``notifications/cancelled``) stops the command and frees the device; the job ends
    ``cancelled``.  Negative control: the same call, not cancelled, answers its timing."""
    import sqlite3

    import anyio

    pytest.importorskip("mcp", reason="the `server` extra is not installed")
    from mcp_support import session_run, structured

    pid, flag = tmp_path / "cancelled.pid", tmp_path / "control.go"
    seen: dict = {}

    def script(name: str, go) -> str:
        return f"echo $$ > {tmp_path / name}; while [ ! -e {go} ]; do sleep 0.02; done"

    async def body(session) -> None:
        async with anyio.create_task_group() as tg:
            async def call() -> None:
                await session.call_tool("bench_command", {
                    "command": script("cancelled.pid", tmp_path / "never"), "runs": 1,
                    "warmup": 0})
                seen["finished"] = True  # never: the call is cancelled first
            tg.start_soon(call)
            with anyio.fail_after(60):
                while not (pid.exists() and pid.read_text().strip()):
                    await anyio.sleep(0.02)
            seen["t"] = time.monotonic()
            tg.cancel_scope.cancel()
        with anyio.fail_after(60):
            while not _gone(int(pid.read_text())):
                await anyio.sleep(0.02)
        seen["stopped_s"] = time.monotonic() - seen["t"]
        flag.touch()
        seen["control"] = structured(await session.call_tool("bench_command", {
            "command": script("control.pid", flag), "runs": 1, "warmup": 0}))

    anyio.run(session_run, tmp_path, body)
    assert "finished" not in seen
    assert seen["stopped_s"] < 30, seen  # a cancelled bench's command dies in seconds at most
    assert seen["control"]["runs"] == 1 and seen["control"]["region_id"] is not None, seen
    _region_granted_now()
    db = sqlite3.connect(tmp_path / "state" / "jobs-mcp.sqlite3")
    states = sorted(r[0] for r in db.execute("SELECT state FROM jobs WHERE kind='bench'"))
    db.close()
    assert states == ["cancelled", "succeeded"], states


def test_cancel_kills_an_exec_whose_program_moved_to_another_directory(service, tmp_path):
    """The service finds a running exec's worker by what the daemon says it serves (the
    directory its request named), not by the worker's working directory now: a program
    that calls ``chdir`` is killed, with the process it started.  Negative control: an
    exec that did not move is killed the same way, and the pool serves on."""
    for moves in (True, False):
        pids = tmp_path / f"pids-{moves}"
        prog = ("import os, subprocess, time\n"
                + ("os.chdir('/')\n" if moves else "")
                + "child = subprocess.Popen(['sleep', '600'])\n"
                f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
                "while True:\n    time.sleep(0.05)\n")
        _, job = service.call("POST", "/v1/jobs/exec", {"program": prog})
        wait_for(lambda p=pids: p.exists() and len(p.read_text().split()) == 2, timeout_s=60)
        worker, child = (int(x) for x in pids.read_text().split())
        status, _ = service.call("POST", f"/v1/jobs/{job['id']}/cancel")
        assert status == 200
        ended = service.wait(job["id"], wait_s=30)
        assert ended["state"] == "cancelled", (moves, ended)
        wait_for(lambda w=worker, c=child: _gone(w) and _gone(c), timeout_s=10)
    _, after = service.call("POST", "/v1/jobs/exec", {"program": "print('next')\n"})
    assert service.wait(after["id"])["result"]["stdout"] == "next\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="a worker's own cgroup needs root")
def test_cancel_kills_what_an_exec_double_forked_away(service, tmp_path):
    """A program that double-forks a sleeper (its parent exits: the sleeper is no longer
    in the worker's process tree) is still in the worker's cgroup: the daemon kills the
    cgroup, so cancel leaves nothing running.  Control, in the same run: at the cancel
    the sleeper is outside the worker's process tree (a tree kill would miss it)."""
    import psutil

    pids, spot = tmp_path / "pids", tmp_path / "sleeper"
    prog = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    if os.fork() == 0:\n"
            f"        open({str(spot)!r}, 'w').write(str(os.getpid()))\n"
            "        time.sleep(600)\n"
            "    os._exit(0)\n"
            f"while not os.path.exists({str(spot)!r}) or not open({str(spot)!r}).read():\n"
            "    time.sleep(0.01)\n"
            f"sleeper = open({str(spot)!r}).read()\n"
            f"open({str(pids)!r}, 'w').write(str(os.getpid()) + ' ' + sleeper)\n"
            "while True:\n    time.sleep(0.05)\n")
    _, job = service.call("POST", "/v1/jobs/exec", {"program": prog})
    wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 2, timeout_s=60)
    worker, sleeper = (int(x) for x in pids.read_text().split())
    tree = {p.pid for p in psutil.Process(worker).children(recursive=True)}
    assert sleeper not in tree and psutil.pid_exists(sleeper), (worker, sleeper, tree)
    status, _ = service.call("POST", f"/v1/jobs/{job['id']}/cancel")
    assert status == 200
    assert service.wait(job["id"], wait_s=30)["state"] == "cancelled"
    wait_for(lambda: _gone(worker) and _gone(sleeper), timeout_s=10)
