"""Gate and drain against the fake GPU: nothing gets through a closed gate,
and a drain is acknowledged only once the sibling's queued work has run."""

from __future__ import annotations

import signal
import time

import pytest
from helpers import reap, spawn, wait_for
from test_native import build_launcher, parse_report

from krex.devices import native
from krex.devices.fakegpu import FakeGpu
from krex.enforce.gate import GateFile, file_size
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
