"""The driver's checkpoint-lock backend on fakegpu, which models what NVIDIA documents:
the lock blocks further calls but does not wait for submitted work.

The daemon's side runs in a child process each time (as the daemon is one): a driver
library loaded into the test process would stand in for every later ``libcuda.so.1``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import types

import pytest
from helpers import PY, reap, spawn
from native_support import build_drainer

from krex.devices import native
from krex.devices.fakegpu import FakeGpu
from krex.enforce.checkpointlock import NvmlIdle

DAEMON_SIDE = """
import json, sys
from krex.devices.fakegpu import FakeGpu
from krex.enforce.checkpointlock import CheckpointLock, FakegpuIdle, load_driver
from krex.errors import DrainTimeout
path, sock, pids, idle, timeout_s = json.loads(sys.argv[1])
gpu = FakeGpu(sock)
op = CheckpointLock(load_driver(path), path, pids, timeout_s=timeout_s,
                    idle=FakegpuIdle(gpu) if idle else None)
out = {"error": None}
try:
    op.apply()
except DrainTimeout as exc:
    out["error"] = exc.message
out.update(locked=list(op.locked), skipped=op.skipped, findings=op.findings(),
           queued={str(p): gpu.queued(p) for p in pids})
op.revert()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def drainer_bin():
    built = build_drainer()
    yield built
    shutil.rmtree(os.path.dirname(built), ignore_errors=True)


@pytest.fixture
def gpu():
    with FakeGpu() as g:
        yield g


def lock(gpu, pids, idle=True, timeout_s=5.0) -> dict:
    """Apply (and revert) the checkpoint lock of ``pids`` as the daemon does, in a child."""
    path = str(native.fakegpu_lib_dir() / "libcuda.so.1")
    arg = json.dumps([path, gpu.socket_path, pids, idle, timeout_s])
    done = subprocess.run([sys.executable, "-c", DAEMON_SIDE, arg], env=gpu.env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def queued_sibling(drainer_bin, gpu, kernel_us=100_000):
    """A process with 3 kernels of ``kernel_us`` queued on its context and no call in
    progress."""
    env = {**gpu.env(), "DRAINER_LONG_KERNEL": f"spin_us_{kernel_us}"}
    proc = spawn([str(drainer_bin), "destroyed"], env=env, stdin=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_lock_returns_before_queued_work_ran_then_the_daemon_waits(drainer_bin, gpu):
    # 3 x 0.7 s: work must still be queued when the lock (a fresh process) returns, however
    # slowly that process starts on a loaded machine (3 x 0.1 s ran out before it here).
    sib = queued_sibling(drainer_bin, gpu, kernel_us=700_000)
    try:
        seen = lock(gpu, [sib.pid], idle=False)
        assert seen["locked"] == [sib.pid] and seen["error"] is None
        assert seen["queued"][str(sib.pid)] > 0  # documented: the lock does not wait for it
        assert seen["findings"] and "cannot confirm" in seen["findings"][0]["why"]
        seen = lock(gpu, [sib.pid])  # with the device's view: wait for it
        assert seen["queued"][str(sib.pid)] == 0 and seen["findings"] == []
    finally:
        sib.communicate("go\n", timeout=30)
        reap(sib)


def test_processes_without_a_context_are_skipped(gpu):
    plain = spawn([PY, "-c", "import time; time.sleep(30)"])
    try:
        seen = lock(gpu, [plain.pid])
        assert seen["skipped"] == [plain.pid] and seen["locked"] == [] and seen["findings"] == []
    finally:
        reap(plain)


def test_a_lock_timeout_is_not_ready_and_leaves_the_process_running(drainer_bin, gpu):
    # the "destroyed" scenario ends with a sync of its 3 x 1 s: a call in progress
    env = dict(gpu.env(), DRAINER_LONG_KERNEL="spin_us_1000000")
    busy = spawn([str(drainer_bin), "destroyed"], env=env, stdin=subprocess.PIPE)
    try:
        assert busy.stdout.readline().strip() == "ready"
        busy.stdin.write("go\n")
        busy.stdin.flush()  # now inside cuCtxSynchronize for ~3 s
        time.sleep(0.05)
        seen = lock(gpu, [busy.pid], timeout_s=0.05)
        assert "could not be locked" in seen["error"] and seen["locked"] == []
        assert busy.wait(timeout=30) == 0  # it went on: not left locked
    finally:
        reap(busy)


def test_nvml_idle_needs_a_zero_sample_after_the_lock():
    class Err(Exception):
        pass

    def fake(values):
        samples = [types.SimpleNamespace(timeStamp=t, sampleValue=types.SimpleNamespace(uiVal=v))
                   for t, v in values]
        return types.SimpleNamespace(NVMLError=Err, NVML_GPU_UTILIZATION_SAMPLES=1,
                                     nvmlDeviceGetSamples=lambda h, k, since: (0, samples))

    since = 100.0
    busy = NvmlIdle(fake([(99_000_000, 0), (100_100_000, 50), (100_200_000, 30)]), None)
    assert busy.wait([1], since, 0.1)[0] is False  # negative control
    idle = NvmlIdle(fake([(100_100_000, 40), (100_200_000, 0)]), None)
    assert idle.wait([1], since, 0.1) == (True, "")
