"""The driver's checkpoint-lock backend on fakegpu, which models what NVIDIA documents:
the lock blocks further calls but does not wait for submitted work."""

from __future__ import annotations

import subprocess
import time
import types

import pytest
from helpers import PY, reap, spawn
from test_gate import drainer

from krex.devices import native
from krex.devices.fakegpu import FakeGpu
from krex.enforce.checkpointlock import CheckpointLock, FakegpuIdle, NvmlIdle, load_driver
from krex.errors import DrainTimeout


@pytest.fixture(scope="module")
def drainer_bin():
    return drainer()


@pytest.fixture
def gpu(monkeypatch):
    with FakeGpu() as g:
        monkeypatch.setenv("KREX_FAKEGPU_SOCKET", g.socket_path)
        yield g


def lock_op(gpu, pids, idle=True, timeout_s=5.0):
    path = str(native.fakegpu_lib_dir() / "libcuda.so.1")
    return CheckpointLock(load_driver(path), path, pids, timeout_s=timeout_s,
                          idle=FakegpuIdle(gpu) if idle else None)


def queued_sibling(drainer_bin, gpu):
    """A process with 3 x 100 ms queued on its context and no call in progress."""
    proc = spawn([str(drainer_bin), "destroyed"], env=gpu.env(), stdin=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_lock_returns_before_queued_work_ran_then_the_daemon_waits(drainer_bin, gpu):
    sib = queued_sibling(drainer_bin, gpu)
    try:
        op = lock_op(gpu, [sib.pid], idle=False)
        op.apply()
        assert op.locked == [sib.pid]
        assert gpu.queued(sib.pid) > 0  # documented: the lock does not wait for the work
        assert op.findings() and "cannot confirm" in op.findings()[0]["why"]
        op.revert()
        op = lock_op(gpu, [sib.pid])  # with the device's view: wait for it
        op.apply()
        assert gpu.queued(sib.pid) == 0 and op.findings() == []
        op.revert()
    finally:
        sib.communicate("go\n", timeout=30)
        reap(sib)


def test_processes_without_a_context_are_skipped(gpu):
    plain = spawn([PY, "-c", "import time; time.sleep(30)"])
    try:
        op = lock_op(gpu, [plain.pid])
        op.apply()
        assert op.skipped == [plain.pid] and op.locked == [] and op.findings() == []
        op.revert()
    finally:
        reap(plain)


def test_a_lock_timeout_is_not_ready_and_leaves_the_process_running(drainer_bin, gpu):
    # the "destroyed" scenario ends with a sync of its 3 x 100 ms: a call in progress
    busy = spawn([str(drainer_bin), "destroyed"], env=gpu.env(), stdin=subprocess.PIPE)
    try:
        assert busy.stdout.readline().strip() == "ready"
        busy.stdin.write("go\n")
        busy.stdin.flush()  # now inside cuCtxSynchronize for ~0.3 s
        time.sleep(0.05)
        op = lock_op(gpu, [busy.pid], timeout_s=0.05)
        with pytest.raises(DrainTimeout, match="could not be locked"):
            op.apply()
        assert op.locked == []
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
