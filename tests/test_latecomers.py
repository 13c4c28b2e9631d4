"""Latecomers through a real daemon (issue 11 item 1): a job started, or a process that
registers, while a region holds the device runs no instruction until the region ends.

Negative control: the same on a daemon with freezing off shows the latecomer running
inside the region.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import psutil
import pytest
from helpers import PY, Daemon, krex, reap, spawn, wait_for

from krex.enforce.cgroups import CgroupLayout

# Enters a region, says so (IN_FILE: monotonic time), holds it busy for HOLD_S and then
# until RELEASE_FILE exists (at most 30 s more), writes OUT_FILE: {"t_in", "t_out"}
# (monotonic seconds).
HOLDER = r"""
import json, os, sys, time, krex
in_file, out_file, hold_s, release = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
with krex.region(label="hold"):
    t_in = time.monotonic()
    with open(in_file + ".tmp", "w") as f:
        f.write(repr(t_in))
    import os; os.rename(in_file + ".tmp", in_file)
    end, cap = time.monotonic() + hold_s, time.monotonic() + hold_s + 30
    while time.monotonic() < end or (not os.path.exists(release) and time.monotonic() < cap):
        pass
    t_out = time.monotonic()
with open(out_file, "w") as f:
    json.dump({"t_in": t_in, "t_out": t_out}, f)
"""

# A managed latecomer's first instruction: the time it ran (monotonic seconds).
FIRST = "import sys, time; open(sys.argv[1], 'w').write(repr(time.monotonic()))"

# An ad-hoc latecomer: registers (joins its job's cgroup under the device), then
# writes the time of its next instruction.
ADHOC = r"""
import sys, time
from krex.client.connection import Client
with Client() as c:
    c.register(name="late-adhoc")
    t = time.monotonic()
open(sys.argv[1], "w").write(repr(t))
"""


def _freezing_layout() -> None:
    layout = CgroupLayout.probe()
    if not (layout.v2_writable or layout.freezer_writable):
        pytest.skip(f"no writable freezer cgroup here: {layout.reasons}")


def _wait_quietly(cond, timeout_s: float = 20.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(psutil.Error, OSError):
            if cond():
                return True
        time.sleep(0.02)
    return False


def _first(path: str) -> float:
    wait_for(lambda: os.path.exists(path) and os.path.getsize(path) > 0, timeout_s=30)
    with open(path) as f:
        return float(f.read())


@pytest.mark.parametrize("freeze", ["auto", "cgroup1", "off"])
def test_latecomers_run_nothing_during_the_region(freeze, runtime_dir, monkeypatch, tmp_path):
    _freezing_layout()
    if freeze == "cgroup1" and not CgroupLayout.probe().freezer_writable:
        pytest.skip("no writable v1 freezer here")
    d = Daemon(str(runtime_dir), "--freeze", freeze, "--no-isolate").start()
    monkeypatch.setenv("KREX_SOCKET", d.socket)
    t_in_file, out = str(tmp_path / "in"), str(tmp_path / "out")
    late_run, late_adhoc = str(tmp_path / "late_run"), str(tmp_path / "late_adhoc")
    procs = []
    try:
        release = str(tmp_path / "release")
        holder = krex("run", "--name", "holder", "--", PY, "-c", HOLDER, t_in_file, out, "1.5",
                      release)
        procs.append(holder)
        wait_for(lambda: os.path.exists(t_in_file), timeout_s=30)
        late = krex("run", "--name", "late", "--", PY, "-c", FIRST, late_run)
        procs.append(late)
        procs.append(spawn([PY, "-c", ADHOC, late_adhoc]))
        # The region lasts until the latecomers were there to run: a loaded machine can take
        # longer than the 1.5 s to start them.  Control (freezing off): until both ran.
        # Freezing: until `krex run`'s child exists (then 0.5 s), never until they ran.
        if freeze == "off":
            _wait_quietly(lambda: os.path.exists(late_run) and os.path.exists(late_adhoc))
        elif _wait_quietly(lambda: bool(psutil.Process(late.pid).children())):
            time.sleep(0.5)
        open(release, "w").close()
        _, err = holder.communicate(timeout=60)
        assert holder.returncode == 0, err
        with open(out) as f:
            seen = json.load(f)
        first_run, first_adhoc = _first(late_run), _first(late_adhoc)
    finally:
        for p in procs:
            reap(p)
        d.stop()
    if freeze == "off":  # control: without freezing, the latecomers run meanwhile
        assert seen["t_in"] < first_run < seen["t_out"], (seen, first_run)
        assert seen["t_in"] < first_adhoc < seen["t_out"], (seen, first_adhoc)
    else:
        assert first_run > seen["t_out"], f"krex run's child ran {seen['t_out'] - first_run} s"
        assert first_adhoc > seen["t_out"], f"registered ran {seen['t_out'] - first_adhoc} s"


def test_command_mode_child_joins_the_holders_slot(daemon, tmp_path):
    """``krex run --mode command`` holds its device before starting its child: the child
    must run (in the holder's slot), not freeze with the device's subtree."""
    _freezing_layout()
    path = str(tmp_path / "first")
    p = krex("run", "--mode", "command", "--", PY, "-c", FIRST, path)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert _first(path) > 0
