"""Shared pieces of the enforcement tests (no tests here): progress-writing siblings, holders."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time

import pytest
from helpers import PY, reap, spawn, wait_for

from krex.enforce.cgroups import CgroupLayout, JobCgroups
from krex.enforce.job import JobTarget
from krex.enforce.process import ProcessGroup, ProcessRef

# A sibling job: a busy loop that appends "<monotonic time>" every ~1000
# iterations to PATH.<pid>; with FORK=1 it first forks once (two processes).
SIBLING = r"""
import os, sys, time
path, fork = sys.argv[1], sys.argv[2] == "1"
if fork:
    os.fork()
f = open(f"{path}.{os.getpid()}", "a", buffering=1)
n = 0
while True:
    n += 1
    if n % 2000 == 0:
        f.write(f"{time.monotonic()}\n")
"""

# A multi-threaded holder: THREADS busy threads plus the main thread.
HOLDER = r"""
import sys, threading, time
def spin():
    while True:
        time.sleep(0.001)
for _ in range(int(sys.argv[1])):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""


def layout_or_skip(kind: str) -> CgroupLayout:
    layout = CgroupLayout.probe()
    ok = {"cgroup2": layout.v2_writable, "cgroup1": layout.freezer_writable}.get(kind, True)
    if not ok:
        pytest.skip(f"{kind} unavailable here: {layout.reasons}")
    return layout


def stamps(path: str) -> list[float]:
    out = []
    for name in glob.glob(path + ".*"):
        with open(name) as f:
            out += [float(x) for x in f.read().split()[:-1]]  # last may be partial
    return sorted(out)


def stamps_after(path: str, t: float) -> list[float]:
    return [x for x in stamps(path) if x > t]


class Sibling:
    """A progress-writing job in its own session (optionally in job cgroups)."""

    def __init__(
        self, tmp: str, job_id: int, cgroups: JobCgroups | None = None, fork: bool = False
    ):
        self.path = os.path.join(tmp, f"sib{job_id}")
        pre = cgroups.join_self if cgroups else None
        self.proc = spawn(
            [PY, "-c", SIBLING, self.path, "1" if fork else "0"],
            start_new_session=True,
            preexec_fn=pre,
        )
        self.target = JobTarget(
            job_id, root=ProcessRef.of(self.proc.pid), group=ProcessGroup.led_by(self.proc.pid),
            cgroups=cgroups,
        )
        wait_for(lambda: len(self.stamps()) >= (4 if fork else 2), timeout_s=10)
        if fork:
            wait_for(lambda: len(glob.glob(self.path + ".*")) == 2, timeout_s=10)

    def stamps(self) -> list[float]:
        return stamps(self.path)

    def progressed_after(self, t: float) -> bool:
        return bool(stamps_after(self.path, t))

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap(self.proc)


def assert_frozen_then_resumes(sib: Sibling, frozen_at: float, thawed_at: float) -> None:
    during = [x for x in sib.stamps() if frozen_at < x < thawed_at]
    assert not during, f"sibling progressed while frozen: {len(during)} stamps"
    wait_for(lambda: sib.progressed_after(thawed_at), timeout_s=10)


def hold(seconds: float = 0.3) -> tuple[float, float]:
    """Sleep while frozen; the interval the sibling must show no progress in."""
    t0 = time.monotonic()
    time.sleep(seconds)
    return t0, time.monotonic()


def start_holder(threads: int = 3) -> subprocess.Popen:
    proc = spawn([PY, "-c", HOLDER, str(threads)], start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc
