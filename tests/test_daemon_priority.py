"""The daemon's threads run in SCHED_RR (or at a nice value); what they start does not.

A handoff is a chain of the daemon's thread wake-ups; on a loaded machine each
waited for a CPU behind the contenders (docs/notes/handoff.md).  The daemon's
threads raise themselves (``--rt-priority``, default 1; ``--nice``), each for
itself, with ``SCHED_RESET_ON_FORK`` so workers, the guardian and jobs never
inherit it, and keep off the holders' reserved cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import psutil
import pytest
from helpers import Daemon

from krex.client.connection import Client
from krex.daemon import priority
from krex.enforce.isolation import default_cores

root = pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root")


def _nices(pid: int) -> list[int]:
    return [priority.thread_nice(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")]


def _serve_one_region(d: Daemon) -> tuple[dict, list[int]]:
    """A region through ``d`` (a session thread and the device's lane exist then); the
    daemon's status and its threads' nice values while the connection is open."""
    c = Client(d.socket, autostart=False)
    try:
        job = c.register()["job_id"]
        c.release(c.acquire(job)["region"])
        assert d.proc is not None
        return c.status()["daemon"]["priority"], _nices(d.proc.pid)
    finally:
        c.close()


def _affinity(tid: int) -> set[int]:
    """A thread's cores; none for one that ended meanwhile (a session's thread may end
    between the listing and this read: seen once beside a CPU loop)."""
    try:
        return set(os.sched_getaffinity(tid))
    except ProcessLookupError:
        return set()


def _policy(tid: int) -> int:
    try:
        return os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK
    except ProcessLookupError:  # the thread ended meanwhile
        return -1


@root
def test_the_daemons_threads_run_in_sched_rr_and_its_children_do_not(runtime_dir, tmp_path):
    """Elevated daemon threads keep off the holders' reserved core (there they would take
    it from a holder on waking); the guardian and a worker started for a program run at
    SCHED_OTHER, nice 0, on every core."""
    d = Daemon(str(runtime_dir), "--rt-priority", "1").start()
    try:
        status, _ = _serve_one_region(d)
        assert status == {"nice": 0, "rt_priority": 1, "applied": True, "policy": "rr",
                          "why": None}
        prog = tmp_path / "prog.py"
        prog.write_text("print('ok')\n")
        c = Client(d.socket, autostart=False)
        try:
            c.exec(str(prog))
        finally:
            c.close()
        assert d.proc is not None
        tids = [int(t) for t in os.listdir(f"/proc/{d.proc.pid}/task")]
        rr = [t for t in tids if _policy(t) == os.SCHED_RR]
        # the accepting thread, the ticker, the lane, the event writer, a session
        assert len(rr) >= 4, [(t, _policy(t)) for t in tids]
        every = sorted(os.sched_getaffinity(0))
        reserved = default_cores(every)
        assert all(not _affinity(t) & set(reserved) for t in rr)
        # (a child caught between fork and exec still reads as the daemon: left out)
        children = [p for p in psutil.Process(d.proc.pid).children(recursive=True)
                    if "serve" not in p.cmdline()]
        assert any("krex.workers" in " ".join(p.cmdline()) for p in children), children
        # the guardian lowers itself to SCHED_BATCH (no wake-up preemption of the
        # daemon); everything else it starts is at SCHED_OTHER; none at the daemon's
        want = {True: os.SCHED_BATCH, False: os.SCHED_OTHER}
        assert all(_policy(p.pid) == want["krex.enforce.guardian" in p.cmdline()]
                   and p.nice() == 0 and sorted(p.cpu_affinity()) == every
                   for p in children), \
            [(p.cmdline(), _policy(p.pid), p.nice(), p.cpu_affinity()) for p in children]
    finally:
        d.stop()


@root
@pytest.mark.parametrize("nice", [-10, 0], ids=["nice-instead-of-rr", "control-default"])
def test_a_nice_value_instead_of_rr_or_neither(runtime_dir, nice):
    """``--nice -10``: the threads at nice -10, children at 0.  Control: the default
    (both off) raises no thread, and status says why."""
    flags = ("--nice", str(nice)) if nice else ()
    d = Daemon(str(runtime_dir), *flags).start()
    try:
        status, nices = _serve_one_region(d)
        assert d.proc is not None
        policies = {_policy(int(t)) for t in os.listdir(f"/proc/{d.proc.pid}/task")}
        assert policies == {os.SCHED_OTHER}, policies
        if nice:
            assert status["policy"] == "nice" and status["applied"] is True
            assert nices.count(nice) >= 4, nices
            children = psutil.Process(d.proc.pid).children(recursive=True)
            assert children and all(p.nice() == 0 for p in children)
        else:
            assert status["applied"] is False and "disabled" in status["why"]
            assert set(nices) == {0}, nices
    finally:
        d.stop()


def _in_thread(fn):
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@root
def test_what_an_elevated_thread_starts_begins_at_nice_zero(monkeypatch):
    """A thread and a process started by an elevated thread are back at nice 0 (the
    reset-on-fork flag); without the flag both would inherit -10."""
    monkeypatch.setattr(priority, "_state", {"nice": -10, "rt": 0, "applied": False, "why": ""})
    monkeypatch.setattr(priority, "_cores", {"all": [], "rest": []})

    def elevated_then_start() -> tuple[int, int, int]:
        assert priority.elevate()
        me = priority.thread_nice(os.getpid(), threading.get_native_id())
        child: dict = {}
        t = threading.Thread(target=lambda: child.setdefault(
            "nice", priority.thread_nice(os.getpid(), threading.get_native_id())))
        t.start()
        t.join()
        proc = subprocess.run([sys.executable, "-c", "import os; print(os.nice(0))"],
                              capture_output=True, text=True, check=True)
        return me, child["nice"], int(proc.stdout)

    assert _in_thread(elevated_then_start) == (-10, 0, 0)


def test_a_refused_nice_leaves_the_thread_as_it_was_and_says_why(monkeypatch):
    monkeypatch.setattr(priority, "_state", {"nice": -10, "rt": 0, "applied": False, "why": ""})
    monkeypatch.setattr(priority, "_cores", {"all": [], "rest": []})

    def refuse(*_args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    before = _in_thread(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert _in_thread(priority.elevate) is False
    assert priority.describe()["applied"] is False
    assert "not permitted" in str(priority.describe()["why"])
    assert before == _in_thread(
        lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))


@root
def test_a_refused_rt_priority_falls_back_to_the_nice_value(monkeypatch):
    monkeypatch.setattr(priority, "_state", {"nice": -10, "rt": 1, "applied": False, "why": ""})
    monkeypatch.setattr(priority, "_cores", {"all": [], "rest": []})
    real = os.sched_setscheduler

    def no_rr(tid: int, policy: int, param: os.sched_param) -> None:
        if policy & ~os.SCHED_RESET_ON_FORK == os.SCHED_RR:
            raise PermissionError(1, "Operation not permitted")
        real(tid, policy, param)

    monkeypatch.setattr(os, "sched_setscheduler", no_rr)
    nice = _in_thread(lambda: (priority.elevate(),
                               priority.thread_nice(os.getpid(), threading.get_native_id())))
    assert nice == (True, -10)
    d = priority.describe()
    assert d["policy"] == "nice" and "rr not permitted" in str(d["why"]), d
