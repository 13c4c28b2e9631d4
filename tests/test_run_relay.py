"""``krex run``'s output relay: a command frozen mid-write still delivers all it wrote.

Through a real daemon: a loop job takes 3 ms regions back to back, so every other job
of the device is frozen most of the time.  A program prints 256 KiB at once, with
``PYTHONUNBUFFERED=1``, to a pipe this test reads slowly.  Control, in the same run:
the program as an ad-hoc job of the device (it registers with one region, then
prints), frozen while blocked on the full pipe, loses the end of its line
(docs/enforce.md, "A frozen writer's write comes back short").  Through ``krex run``,
whose stdout is the relay's pipe, all of it arrives, every time.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
from daemon_support import daemon_counters, freezes, start_steps
from helpers import PY, reap, wait_for

SIZE = 262144
PROGRAM = f"""
import sys, time
import krex
with krex.region("cpu"):  # an ad-hoc job's registration; krex run's job has one already
    pass
time.sleep(0.3)  # the loop's regions freeze it from now on
print("y" * {SIZE})
"""


def _slowly(proc: subprocess.Popen) -> bytes:
    """All of ``proc``'s stdout, read 4 KiB every 2 ms (its writes wait on us)."""
    out: list[bytes] = []

    def read() -> None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, 4096):
            out.append(chunk)
            time.sleep(0.002)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    proc.wait(timeout=60)
    t.join(30)
    return b"".join(out)


def _run(daemon, argv: list[str]) -> bytes:
    env = {**os.environ, "KREX_SOCKET": daemon.socket, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env)
    try:
        return _slowly(proc)
    finally:
        reap(proc)


def test_a_frozen_command_delivers_its_whole_output_through_krex_run(daemon):
    if not freezes(daemon):
        pytest.skip("no freeze backend here: no job is frozen while another holds")
    loop = start_steps(daemon, *["r0.003"] * 4000)
    try:
        wait_for(lambda: daemon_counters(daemon)["granted"] >= 20, 30)  # the loop holds
        ad_hoc = [_run(daemon, [PY, "-c", PROGRAM]) for _ in range(3)]
        relayed = [_run(daemon, [PY, "-m", "krex", "run", "--", PY, "-c", PROGRAM])
                   for _ in range(3)]
        assert loop.poll() is None, "the loop ended before the programs did"
    finally:
        reap(loop)
    whole = b"y" * SIZE + b"\n"
    # control: frozen while its write waited on the pipe, the ad-hoc job lost the rest
    assert any(out != whole for out in ad_hoc), [len(out) for out in ad_hoc]
    assert all(out == whole for out in relayed), [len(out) for out in relayed]
