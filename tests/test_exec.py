"""``krex exec`` and ``Client.exec``/``submit`` through a real daemon and its warm pool."""

import json
import os

import pytest
from helpers import descendants, krex, run_krex

from krex.devices import fakegpu

PROG = """
import os, sys, krex
print("pid", os.getpid(), "args", " ".join(sys.argv[1:]), flush=True)
with krex.region(label="in-worker") as r:
    pass
print("mode", r.report.mode, "job", os.environ["KREX_JOB_ID"])
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def test_exec_runs_in_the_same_warm_worker_with_regions(daemon, tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    first = run_krex("exec", str(prog), "a", "b")
    second = run_krex("exec", str(prog), "c", env={**os.environ, "EXIT": "3"})
    assert first.returncode == 0, first.stderr
    assert second.returncode == 3
    pid1 = first.stdout.split()[1]
    assert f"pid {pid1} args c" in second.stdout  # same warm worker, new argv
    assert "mode region" in first.stdout
    with daemon.client() as c:
        labels = [r["label"] for r in c.regions()]
        pools = c.status()["pools"]
    assert labels.count("in-worker") == 2
    assert pools["cpu"]["served"] == 2


def test_each_result_brackets_exactly_its_own_regions(daemon, tmp_path):
    """``started_mono_s``..``ended_mono_s`` is on the daemon's clock: back-to-back programs
    in one worker each own exactly the regions they asked for (a region taken as
    the first statement included)."""
    prog = tmp_path / "first.py"
    prog.write_text("import krex\nwith krex.region(label='x'):\n    pass\n")
    with daemon.client() as c:
        results = [c.exec(str(prog), [], cwd=str(tmp_path)) for _ in range(5)]
        records = c.regions()
    assert all(r.ok for r in results)
    assert len({r.worker_pid for r in results}) == 1
    stamps = [rec["requested_mono_s"] for rec in records if rec["label"] == "x"]
    assert len(stamps) == 5
    for r in results:
        inside = [t for t in stamps if r.started_mono_s <= t <= r.ended_mono_s]
        assert len(inside) == 1, (r.started_mono_s, r.ended_mono_s, stamps)


LEAVE_OPEN = """
import decimal, sys, krex
from krex.client import connection
r = krex.region(label="left-open")
r.__enter__()  # never left: the program ends holding it
sys.modules["krex.client.region"]._state.conn.rewired = True  # a candidate's tampering
connection.ACTING_FOR.set("someone-else")
decimal.getcontext().prec = 5
import gc
gc.freeze()  # nor will a collection close its connection by chance
"""
NEXT = """
import json, os, sys, time, krex
from krex.client import connection
t0 = time.monotonic()
with krex.region(label="next"):
    waited = time.monotonic() - t0
    state = sys.modules["krex.client.region"]._state
    depth, rewired = dict(state.depth), getattr(state.conn, "rewired", False)
import decimal
with open("seen.json", "w") as f:
    json.dump({"waited": waited, "depth": depth, "acting_for": connection.ACTING_FOR.get(),
               "rewired": rewired, "prec": decimal.getcontext().prec, "pid": os.getpid()}, f)
"""


def test_a_region_a_program_left_open_ends_with_it(daemon, tmp_path):
    """A region a program in a warm worker left open is released when the program ends,
    and nothing of the program's krex.client state or context crosses into the next
    program: not the connection (one the program tampered with would serve the next
    evaluation's region), not the region depth, not a context variable (the tenant acted
    for; decimal's precision leaked into the next program before each program ran in a
    copy of the worker's context: checked without the copy).  Before, only a garbage
    collection of the dropped krex.client module closed the connection -- sometimes not
    for a minute, and the next program (the same job) waited for the revocation at the
    maximum hold, 60 s (made certain here with ``gc.freeze()``)."""
    (tmp_path / "leave.py").write_text(LEAVE_OPEN)
    (tmp_path / "next.py").write_text(NEXT)
    with daemon.client() as c:
        first = c.exec(str(tmp_path / "leave.py"), [], cwd=str(tmp_path))
        second = c.exec(str(tmp_path / "next.py"), [], cwd=str(tmp_path))  # at once
        records = {r["label"]: r for r in c.regions()}
    assert first.ok and second.ok, second
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["pid"] == first.worker_pid  # the same warm worker
    assert seen["waited"] < 10 and seen["depth"] == {"cpu": 1} and seen["acting_for"] is None
    assert seen["rewired"] is False and seen["prec"] == 28
    left = records["left-open"]
    assert left["outcome"] == "owner_gone" and left["released_mono_s"] <= first.ended_mono_s + 5


def test_submit_a_callable_and_see_errors(daemon):
    with daemon.client() as c:
        ok = c.submit(divmod, 17, 5)
        assert ok.ok and ok.returned() == (3, 2)
        bad = c.submit(json.loads, "{")
        assert bad.status == "error" and "JSONDecodeError" in bad.exception
        assert "Traceback" in bad.traceback and "decoder.py" in bad.traceback


def test_exec_json_result_and_timeout(daemon, tmp_path):
    prog = tmp_path / "slow.py"
    prog.write_text("import time\nprint('start', flush=True)\ntime.sleep(30)\n")
    out = run_krex("exec", "--timeout-s", "0.5", "--json", str(prog))
    assert out.returncode == 124
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["status"] == "timeout" and result["recycled"]
    assert result["outcome"] == "timed_out"  # the word a service job's state uses
    assert "start" in out.stdout and "timed out" in out.stderr


def test_exec_missing_program_is_a_usage_error(daemon):
    out = run_krex("exec", "/nonexistent.py")
    assert out.returncode == 1 and "no such program" in out.stderr


def test_status_while_the_first_pool_starts_does_not_deadlock(runtime_dir, monkeypatch, tmp_path):
    """Starting a pool calls back into the daemon; status must not wait on the pool."""
    import threading

    from helpers import Daemon

    d = Daemon(str(runtime_dir), "--workers-min", "2").start()
    monkeypatch.setenv("KREX_SOCKET", d.socket)
    prog = tmp_path / "p.py"
    prog.write_text("print('ok')\n")
    try:
        with d.client() as runner, d.client() as watcher:
            watcher.conn.sock.settimeout(10)  # a deadlock shows as a timeout, not a hang
            results = []
            t = threading.Thread(target=lambda: results.append(
                runner.exec(str(prog), on_output=lambda s, x: None)))
            t.start()
            polls = 0
            while t.is_alive():
                watcher.status()
                polls += 1
            t.join()
        assert results and results[0].ok and polls > 10
    finally:
        d.stop()


def test_a_fakegpu_pool_of_many_workers_starts_them_all_on_one_device_server(make_daemon,
                                                                             tmp_path):
    # The pool starts its workers at once, and each asked for the device's environment: two
    # of them could each start the daemon's fakegpu server on the same socket, and the one
    # that lost the bind failed its worker -- `krex eval` then waited for it without end
    # (once in 16 quick evals on a quiet machine, twice beside a CPU loop).
    if not fakegpu.available():
        pytest.skip("fakegpu was not built")
    d = make_daemon("--workers-min", "6", "--workers-max", "6")
    prog = tmp_path / "noop.py"
    prog.write_text("print('ok')\n")
    for _ in range(3):
        runs = [krex("exec", "--device", "fakegpu:0", str(prog)) for _ in range(6)]
        outs = [p.communicate(timeout=120) for p in runs]
        assert all(p.returncode == 0 for p in runs), [e[-500:] for _, e in outs]
    servers = [p for p in descendants(d.proc.pid) if p.name() == "krex-fakegpu-server"]
    assert len(servers) == 1, servers
    with d.client() as c:
        pool = c.status()["pools"]["fakegpu:0"]
    assert len(pool["workers"]) == 6 and pool["last_start_failure"] is None, pool
