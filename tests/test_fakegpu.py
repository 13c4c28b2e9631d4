"""fakegpu: device-side timing, time slicing, sticky errors, serialised contexts.

Each scenario runs in a child process that drives the fake libcuda.so.1 with
ctypes (a fresh process per server: the fake driver caches its connection)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap

import pytest
from helpers import PY

from krex.devices import fakegpu
from krex.devices.fakegpu import FakeGpu

PRELUDE = textwrap.dedent("""
    import ctypes, json, threading, time
    cu = ctypes.CDLL("libcuda.so.1")
    def ok(rc):
        assert rc == 0, rc
    ok(cu.cuInit(0))
    def context():
        ctx = ctypes.c_void_p()
        ok(cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0))
        return ctx
    def kernel(name):
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        ok(cu.cuModuleLoadData(ctypes.byref(mod), b"x"))
        ok(cu.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()))
        return fn
    def launch(fn, stream=None):
        return cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, None, None)
    def event():
        ev = ctypes.c_void_p()
        ok(cu.cuEventCreate(ctypes.byref(ev), 0))
        return ev
    def elapsed_ms(a, b):
        ms = ctypes.c_float()
        ok(cu.cuEventElapsedTime_v2(ctypes.byref(ms), a, b))
        return ms.value
    def timed(fn):
        a, b = event(), event()
        ok(cu.cuEventRecord(a, None)); ok(launch(fn)); ok(cu.cuEventRecord(b, None))
        ok(cu.cuEventSynchronize(b))
        return elapsed_ms(a, b)
""")


def run_py(gpu: FakeGpu, body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    res = subprocess.run([PY, "-c", code], env=gpu.env(), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture
def gpu():
    with FakeGpu() as g:
        yield g


def test_available_and_env(gpu):
    assert fakegpu.available()
    env = gpu.env(base={"LD_LIBRARY_PATH": "/x"})
    assert env["LD_LIBRARY_PATH"].endswith(":/x") and env["KREX_FAKEGPU_SOCKET"] == gpu.socket_path
    assert gpu.stats() == {"launches": 0, "finished": 0, "busy_ns": 0}


def test_stop_reaps_the_server():
    g = FakeGpu().start()
    proc = g.proc
    g.stop()
    assert proc.poll() is not None and g.proc is None


def test_event_timing_is_device_side_and_precise(gpu):
    r = run_py(gpu, """
        ctx = context()
        samples = [timed(kernel("spin_us_2000")) for _ in range(20)]
        print(json.dumps({"samples": samples}))
    """)
    samples = sorted(r["samples"])
    # Never shorter than the kernel; the fastest of 20 within 10 % of it. (The median was
    # asserted before: a CPU loop beside the suite stretches most spins on 2 cores.)
    assert 1.99 <= samples[0] < 2.2, samples


def test_spin_param_takes_duration_from_the_first_parameter(gpu):
    # The kernel spins for the nanoseconds its first parameter says: never less, and a
    # 4x longer parameter gives a longer kernel by about 4x. Minimums of several launches, so a
    # CPU loop beside the suite (which stretches a spin, never shortens it) cannot fail
    # it; a kernel that ignored its parameter fails the ratio.
    r = run_py(gpu, """
        ctx = context()
        fn = kernel("spin_param")
        def spin(ns_value):
            ns = ctypes.c_uint64(ns_value)
            params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(ns), ctypes.c_void_p))
            a, b = event(), event()
            ok(cu.cuEventRecord(a, None))
            ok(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None))
            ok(cu.cuEventRecord(b, None)); ok(cu.cuEventSynchronize(b))
            return elapsed_ms(a, b)
        short = [spin(2_000_000) for _ in range(5)]
        long = [spin(8_000_000) for _ in range(5)]
        print(json.dumps({"short": short, "long": long}))
    """)
    short, long = min(r["short"]), min(r["long"])
    assert short >= 1.99 and long >= 7.99
    assert 3.0 < long / short < 8.0, (short, long)


def test_a_siblings_queued_work_delays_the_measured_kernel(gpu):
    r = run_py(gpu, """
        busy, measured = context(), context()
        alone = min(timed(kernel("spin_us_1000")) for _ in range(20))  # the fastest: no host gap
        ok(cu.cuCtxSetCurrent(busy))
        long = kernel("spin_us_30000")
        ok(launch(long))
        ok(cu.cuCtxSetCurrent(measured))
        shared = timed(kernel("spin_us_1000"))
        ok(cu.cuCtxSetCurrent(busy)); ok(cu.cuCtxSynchronize())
        print(json.dumps({"alone": alone, "shared": shared}))
    """)
    assert r["alone"] < 1.3
    assert r["shared"] > 1.5 * r["alone"]  # time-sliced with the sibling's 30 ms kernel


def test_poison_is_sticky_for_its_context_only(gpu):
    r = run_py(gpu, """
        bad, good = context(), context()
        ok(cu.cuCtxSetCurrent(bad))
        ok(launch(kernel("poison")))
        first = cu.cuCtxSynchronize()
        again = launch(kernel("spin_us_1"))
        ok(cu.cuCtxSetCurrent(good))
        fine = launch(kernel("spin_us_1"))
        good_sync = cu.cuCtxSynchronize()
        print(json.dumps({"sync": first, "again": again, "fine": fine, "sync_good": good_sync}))
    """)
    assert r == {"sync": 719, "again": 719, "fine": 0, "sync_good": 0}


def test_context_creation_is_serialised_behind_the_delay():
    with FakeGpu(ctx_delay_ms=60) as gpu:
        r = run_py(gpu, """
            t0 = time.monotonic()
            threads = [threading.Thread(target=context) for _ in range(3)]
            [t.start() for t in threads]; [t.join() for t in threads]
            print(json.dumps({"s": time.monotonic() - t0}))
        """)
    assert r["s"] >= 0.17  # three creations, one after the other


def test_memory_round_trip_and_copy_accounting(gpu):
    r = run_py(gpu, """
        ctx = context()
        dptr = ctypes.c_uint64()
        ok(cu.cuMemAlloc_v2(ctypes.byref(dptr), 16))
        src = (ctypes.c_char * 16).from_buffer_copy(b"0123456789abcdef")
        dst = (ctypes.c_char * 16)()
        ok(cu.cuMemcpyHtoD_v2(dptr, src, 16))
        ok(cu.cuMemcpyDtoH_v2(dst, dptr, 16))
        print(json.dumps({"data": dst.raw.decode()}))
    """)
    assert r["data"] == "0123456789abcdef"
    assert gpu.stats()["launches"] == 2 == gpu.stats()["finished"]
    assert [row[3] for row in gpu.launch_log()] == [2, 2]  # both logged as copies


def test_server_exits_when_its_parent_dies():
    """A daemon killed by SIGKILL must not leave its fakegpu server running."""
    import signal
    import subprocess
    import sys

    import psutil
    from helpers import wait_for

    code = ("from krex.devices.fakegpu import FakeGpu; g = FakeGpu().start(); "
            "print(g.proc.pid, g.socket_path, flush=True); import time; time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid, socket_path = parent.stdout.readline().split()
    server = int(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    parent.stdout.close()

    def gone():
        try:
            return psutil.Process(server).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_for(gone, 5)
    # its socket's folder was the killed parent's to remove: the test does it instead
    shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)
