"""A job's process group is matched only while its leader lives (issue 44, item 5).

A group whose leader and members are gone leaves its number free, and the kernel hands
it to the next process that asks: a stranger's.  The daemon (root, on a shared node)
must never freeze that stranger as a member of the old job."""

from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest
from helpers import Daemon, reap, wait_for

NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def _stopped(pid: int) -> bool:
    return psutil.Process(pid).status() == psutil.STATUS_STOPPED


def _spawn_with_pid(pid: int, tries: int = 20) -> subprocess.Popen | None:
    """A process (its own session and group) with this very pid: the kernel's next pid
    set just below it.  None when another process took it first each time."""
    for _ in range(tries):
        with open(NS_LAST_PID, "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "60"], start_new_session=True)
        if p.pid == pid:
            return p
        reap(p)
    return None


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(NS_LAST_PID),
                    reason="reusing a pid on purpose needs root (ns_last_pid)")
def test_a_reused_group_number_never_freezes_a_stranger(runtime_dir):
    d = Daemon(str(runtime_dir), "--freeze", "signal", "--no-isolate").start()
    procs: list[subprocess.Popen] = []
    try:
        with d.client() as owner, d.client() as holder:
            # Control: a live group's member (not a descendant of the job's root) is the
            # job's, and is frozen through another job's region.
            leader = subprocess.Popen(["sleep", "60"], process_group=0)
            member = subprocess.Popen(["sleep", "60"], process_group=leader.pid)
            procs += [leader, member]
            live = owner.create_job(device="cpu", name="live-group", mode="region")["job_id"]
            assert owner.attach_job(live, leader.pid)["attached"]
            # The job whose group empties: its leader (alone in it) exits.
            gone = subprocess.Popen(["sleep", "60"], start_new_session=True)
            procs.append(gone)
            old = owner.create_job(device="cpu", name="old-group", mode="region")["job_id"]
            assert owner.attach_job(old, gone.pid)["attached"]
            number = gone.pid
            reap(gone)
            # (a process is known by pid and start time, in clock ticks: a pid reused
            # within the same tick, 10 ms, cannot be told apart; a real reuse comes after
            # the pids have wrapped around)
            time.sleep(0.05)
            stranger = _spawn_with_pid(number)
            if stranger is None:
                pytest.skip(f"pid {number} was taken by another process each time")
            procs.append(stranger)
            assert os.getpgid(stranger.pid) == number  # the old job's group number
            job = holder.register(name="holder", device="cpu")["job_id"]
            region = holder.acquire(job)["region"]
            try:
                wait_for(lambda: _stopped(member.pid), 5)  # the control: frozen
                time.sleep(0.2)
                assert not _stopped(stranger.pid), "a stranger frozen as the old job's"
            finally:
                holder.release(region)
            wait_for(lambda: not _stopped(member.pid), 5)
    finally:
        for p in procs:
            reap(p)
        d.stop()
