"""A program's long write survives its worker being frozen mid-write.

Freezing a process (cgroup freezer, or a stop signal) while it is blocked writing to a
full pipe ends that ``write(2)`` early with a partial count; a writer that does not
retry loses the rest — CPython's unbuffered streams (``python -u``,
``PYTHONUNBUFFERED=1``) do not. A warm worker's ``sys.stdout`` writes through a
``BufferedWriter``, which retries: a program that prints 256 KiB at once while its
worker is frozen and thawed every few milliseconds, with the pool reading slowly,
delivers all of it, ``PYTHONUNBUFFERED=1`` or not.  Control: in the same run, the
program's own single raw ``os.write`` returns a partial count (the freeze did cut a
write short), so the claim is not vacuous.  Needs root and a writable cgroup v2.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from workers_support import run, write

from krex.enforce.cgroups import CgroupLayout, move_all
from krex.enforce.cgroups import write as cg_write
from krex.workers import PoolSpec, WorkerPool
from krex.workers.process import WorkerProcess

PROGRAM = """
import os, sys
n = os.write(1, b"y" * 200000)  # one raw write: cut short when a freeze comes meanwhile
sys.stderr.write(f"raw {n}\\n")
print("x" * 262144)  # through the worker's stdout
"""


def _flipper(cg: str, stop: threading.Event) -> threading.Thread:
    def flip() -> None:
        while not stop.is_set():
            cg_write(cg + "/cgroup.freeze", "1")
            time.sleep(0.002)
            cg_write(cg + "/cgroup.freeze", "0")
            time.sleep(0.001)
    t = threading.Thread(target=flip, daemon=True)
    t.start()
    return t


def test_a_long_print_survives_freezes_in_a_warm_worker(tmp_path, monkeypatch):
    layout = CgroupLayout.probe()
    if os.geteuid() != 0 or not layout.v2_writable or layout.v2_base is None:
        pytest.skip("needs root and a writable cgroup v2 (cgroup.freeze)")
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # the worker's streams must not depend on it
    read = WorkerProcess._read

    def slowly(self, *args):  # the pool reads slowly: the program's writes block on it
        time.sleep(0.02)
        return read(self, *args)

    monkeypatch.setattr(WorkerProcess, "_read", slowly)
    cg = f"{layout.v2_base}/krex-test-frozen-write-{os.getpid()}"
    os.mkdir(cg)
    stop = threading.Event()
    p = WorkerPool(PoolSpec("cpu", min_workers=1, max_workers=1))
    try:
        p.start()
        worker = p.status()["workers"][0]["pid"]
        cg_write(cg + "/cgroup.procs", str(worker))
        flipper = _flipper(cg, stop)
        result, out = run(p, write(tmp_path, "long.py", PROGRAM), timeout_s=60)
        stop.set()
        flipper.join()
    finally:
        stop.set()
        if os.path.exists(cg + "/cgroup.freeze"):
            cg_write(cg + "/cgroup.freeze", "0")
        move_all(cg, layout.v2_base)
        p.shutdown()
        os.rmdir(cg)
    assert result.ok, (result, out["stderr"][-500:])
    raw = int(out["stderr"].split("raw ")[1].split()[0])
    assert raw < 200000, f"no freeze cut the raw write short ({raw} bytes): the test shows nothing"
    assert out["stdout"] == "y" * raw + "x" * 262144 + "\n"
