"""Gate and drain against the fake GPU: nothing gets through a closed gate,
and a drain is acknowledged only once the sibling's queued work has run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, reap, spawn, wait_for
from native_support import build_drainer, build_launcher, parse_report

from krex.devices import native
from krex.devices.fakegpu import FakeGpu
from krex.enforce.gate import GateFile, drain_reason, file_size
from krex.enforce.process import ProcessRef
from krex.errors import DrainTimeout


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    return build_launcher(tmp_path_factory.mktemp("gate"))


@pytest.fixture
def gpu():
    with FakeGpu() as g:
        yield g


@pytest.fixture
def gate(tmp_path):
    with GateFile.create(tmp_path / "gate", ndev=2) as g:
        yield g


def start(launcher, gpu, gate, *args, slot=0):
    env = native.preload_env(gate.path, slot=slot, base=gpu.env())
    proc = spawn([str(launcher), *args], env=env)
    assert proc.stdout.readline().strip() == "started", proc.stderr.read()
    wait_for(lambda: proc.pid in gate.pids(slot), timeout_s=10)
    return proc


def finish(proc) -> dict[str, int]:
    proc.send_signal(signal.SIGUSR1)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        reap(proc)
    assert proc.returncode == 0, err
    return parse_report(out.strip().splitlines()[-1])


def test_create_layout_and_state(gate):
    assert gate.path.stat().st_size == file_size(2)
    assert not gate.is_closed(0) and gate.generation(0) == 0
    assert gate.close(1) == 1 and gate.is_closed(1) and not gate.is_closed(0)
    assert gate.close(1) == 2
    gate.open(1)
    assert not gate.is_closed(1) and gate.pids(0) == [] and not gate.interposed()
    with pytest.raises(ValueError):
        gate.close(2)


def test_reopen_existing_file(gate):
    gate.close(0)
    again = GateFile.open_existing(gate.path)
    assert again.is_closed(0) and again.generation(0) == 1
    again.release()


CYCLES = 300


@pytest.mark.parametrize("api,mode", [("cuda", "direct"), ("cuda", "ptds"), ("hip", "dlsym")])
def test_no_launch_gets_through_a_closed_gate(launcher, gpu, gate, api, mode):
    proc = start(launcher, gpu, gate, api, mode, "4", "60000", "spin_us_20", "16")
    windows = []
    try:
        for _ in range(CYCLES):
            gate.close(0)
            gate.wait_quiesced(0, timeout_s=5)
            quiet_ns = time.monotonic_ns()
            time.sleep(0.0005)
            windows.append((quiet_ns, time.monotonic_ns()))
            gate.open(0)
            time.sleep(0.0005)
    finally:
        gate.open(0)
        report = finish(proc)
    log = [row for row in gpu.launch_log() if row[1] == proc.pid]
    inside = [t for t, *_ in log if any(a < t < b for a, b in windows)]
    assert inside == [], f"{len(inside)} launches accepted while the gate was closed"
    assert len(log) == report["launches"] > CYCLES  # the log saw every launch
    assert report["parked"] > 0  # threads really met the closed gate


def test_a_launch_parked_after_the_drain_ack_is_counted_at_once(gpu, gate):
    # The drain thread acknowledges a close while the process is idle, publishing its
    # counters then; a launch that parks afterwards must show in the slot's "parked"
    # counter while the gate is still closed (it once showed only at the next drain:
    # gpu_check's "held" check read 0 and failed whenever the ack won that race).
    probe = Path(REPO) / "benchmarks" / "programs" / "held_probe.py"
    env = native.preload_env(gate.path, slot=0, base=gpu.env())
    proc = spawn([sys.executable, str(probe), "ctypes", "fakegpu:0"], env=env,
                 stdin=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        generation = gate.close(0)
        assert set(gate.wait_drained(0, generation, timeout_s=10)) == {proc.pid}
        parked = lambda: sum(s.counters["parked"] for s in gate.slots(0))  # noqa: E731
        assert parked() == 0  # acknowledged while idle: nothing parked yet
        proc.stdin.write("go\n")
        proc.stdin.flush()
        wait_for(lambda: parked() > 0, timeout_s=10)
        assert proc.poll() is None  # held by the closed gate
    finally:
        gate.open(0)
    try:
        assert proc.stdout.readline().startswith("done")
    finally:
        reap(proc)


def test_drain_acks_only_after_queued_work_ran(launcher, gpu, gate):
    # three 100 ms kernels queued per sync: the device holds up to 0.3 s of work
    proc = start(launcher, gpu, gate, "cuda", "getproc", "1", "60000", "spin_us_100000", "3")
    try:
        wait_for(lambda: gpu.stats()["launches"] >= 2, timeout_s=10)
        generation = gate.close(0)
        acks = gate.wait_drained(0, generation, timeout_s=10)
        stats = gpu.stats()
        assert set(acks) == {proc.pid}
        assert stats["finished"] == stats["launches"]  # nothing left queued on the device
        assert acks[proc.pid] > 0.0
        time.sleep(0.05)
        assert gpu.stats()["launches"] == stats["launches"]  # and nothing new got in
    finally:
        gate.open(0)
        report = finish(proc)
    assert report["drains"] >= 1


def test_drain_timeout_names_the_process(launcher, gpu, gate):
    proc = start(launcher, gpu, gate, "cuda", "dlsym", "1", "60000", "spin_us_1000000", "1")
    try:
        wait_for(lambda: gpu.stats()["launches"] >= 1, timeout_s=10)
        generation = gate.close(0)
        with pytest.raises(DrainTimeout) as info:
            gate.wait_drained(0, generation, timeout_s=0.2)
        assert info.value.pid == proc.pid
    finally:
        gate.open(0)
        finish(proc)


def test_gate_slot_selects_the_device_record(launcher, gpu, gate):
    proc = start(launcher, gpu, gate, "hip", "getproc", "2", "60000", "spin_us_10", "8", slot=1)
    try:
        assert gate.pids(0) == [] and gate.pids(1) == [proc.pid]
        generation = gate.close(1)
        assert gate.wait_drained(1, generation, timeout_s=10).keys() == {proc.pid}
        before = gpu.stats()["launches"]
        time.sleep(0.05)
        assert gpu.stats()["launches"] == before
    finally:
        gate.open(1)
        finish(proc)


# -- slots: owners by pid + start time (issue 12) -------------------------------------------


def test_slot_records_its_owners_start_time_and_is_freed_at_exit(launcher, gpu, gate):
    proc = start(launcher, gpu, gate, "cuda", "direct", "1", "60000", "spin_us_10", "8")
    try:
        (slot,) = gate.slots(0)
        assert slot.owner == ProcessRef.of(proc.pid)
    finally:
        finish(proc)
    assert all(p.pid == 0 for p in gate._dev(0).procs)  # given back at exit


def test_a_reused_pid_is_not_a_slot_owner_and_its_slot_is_reclaimed(launcher, gpu, gate):
    """A slot left by a dead process whose pid now names another live process (here: this
    test) must not hold up a drain, and is reclaimed by the next process."""
    stale = gate._dev(0).procs[0]
    stale.pid, stale.start_time = os.getpid(), ProcessRef.of(os.getpid()).start_time + 1
    assert gate.pids(0) == []
    generation = gate.close(0)
    assert gate.wait_drained(0, generation, timeout_s=0.5) == {}  # no DrainTimeout
    gate.open(0)
    proc = start(launcher, gpu, gate, "cuda", "direct", "1", "60000", "spin_us_10", "8")
    try:
        assert gate._dev(0).procs[0].pid == proc.pid  # the stale slot was taken over
    finally:
        finish(proc)


# -- the drain: per stream, capture-safe, honest (issue 16) -----------------------------------


@pytest.fixture(scope="module")
def drainer_bin():
    built = build_drainer()
    yield built
    shutil.rmtree(os.path.dirname(built), ignore_errors=True)


def run_scenario(drainer_bin, gpu, gate, scenario):
    """Start a drainer scenario, close the gate, wait for its drain; (slot, results)."""
    env = native.preload_env(gate.path, base=gpu.env())
    proc = spawn([str(drainer_bin), scenario], env=env, stdin=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "ready"
        generation = gate.close(0)
        acks = gate.wait_drained(0, generation, timeout_s=10)
        stats = gpu.stats()
        (slot,) = gate.slots(0)
        gate.open(0)
        out, err = proc.communicate("go\n", timeout=30)
    finally:
        gate.open(0)
        reap(proc)
    assert proc.returncode == 0 and set(acks) == {proc.pid}, err
    results = dict(kv.split("=") for kv in out.split())
    return slot, results, stats


def test_drain_skips_a_capturing_stream_and_waits_for_the_others(drainer_bin, gpu, gate):
    slot, results, stats = run_scenario(drainer_bin, gpu, gate, "capture")
    assert slot.ack_status == 0 and slot.counters["capturing_skipped"] >= 1
    assert stats["finished"] == stats["launches"] >= 3  # S2's queued kernels ran first
    assert results["capture"] == "0" and results["graph"] == "0"  # the capture survived


def test_fake_driver_invalidates_a_capture_on_a_context_sync(drainer_bin, gpu, gate):
    """Negative control: what a context-wide drain would do to the sibling's capture."""
    _, results, _ = run_scenario(drainer_bin, gpu, gate, "capture_ctxsync")
    assert results["ctxsync"] == "900" and results["capture"] == "901"


def test_default_stream_work_during_a_capture_is_reported_not_drained(drainer_bin, gpu, gate):
    slot, results, _ = run_scenario(drainer_bin, gpu, gate, "default_capture")
    assert slot.ack_status == -2 and slot.counters["drain_failures"] == 1
    assert "capture" in drain_reason(slot.ack_status)
    assert results["capture"] == "0"  # still not broken


def test_a_failed_synchronisation_is_acknowledged_as_failed(drainer_bin, gpu, gate):
    slot, _, _ = run_scenario(drainer_bin, gpu, gate, "poison")
    assert slot.ack_status == 719  # CUDA_ERROR_LAUNCH_FAILED: never a silent ack
    assert slot.counters["sync_errors"] >= 1 and slot.counters["drain_failures"] == 1


def test_destroyed_streams_are_forgotten(drainer_bin, gpu, gate):
    slot, _, stats = run_scenario(drainer_bin, gpu, gate, "destroyed")
    assert slot.ack_status == 0 and slot.counters["sync_errors"] == 0
    assert stats["finished"] == stats["launches"]


def test_a_pointer_the_interposer_cannot_tell_is_counted_in_the_slot(launcher, gpu, gate):
    """cuGetProcAddress asked with a version newer than krex's tables, for which the driver
    hands out another entry point: left unwrapped, and the daemon can see it."""
    proc = start(launcher, gpu, gate, "cuda", "getproc_future", "1", "60000", "spin_us_10", "8")
    try:
        wait_for(lambda: gpu.stats()["launches"] >= 32, timeout_s=10)
        (slot,) = gate.slots(0)
        assert slot.counters["unwrapped"] == slot.counters["unmatched"] == 1
    finally:
        report = finish(proc)
    # only its copies (every 8th call, resolved at 13000) went through a wrapper: its
    # kernel launches bypassed the gate
    assert 0 < report["getproc"] <= report["launches"] // 8 + 1


@pytest.mark.parametrize("api,mode", [("cuda", "direct"), ("hip", "dlsym"), ("hip", "direct")])
def test_every_drain_of_a_plain_launcher_is_acknowledged_clean(launcher, gpu, gate, api, mode):
    """The drain's synchronisation calls are bound for CUDA and HIP alike: an ordinary
    process's drains succeed (a drain that could not happen would say so)."""
    proc = start(launcher, gpu, gate, api, mode, "2", "60000", "spin_us_200", "4")
    try:
        for _ in range(3):
            generation = gate.close(0)
            assert set(gate.wait_drained(0, generation, timeout_s=10)) == {proc.pid}
            (slot,) = gate.slots(0)
            assert slot.ack_status == 0, slot
            gate.open(0)
    finally:
        gate.open(0)
        report = finish(proc)
    assert report["drains"] == 3 and report["drain_failures"] == 0
