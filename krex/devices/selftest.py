"""Interposer self-test: which ways of reaching the driver are caught here.

Runs a tiny program with the interposer preloaded on a gate file against the
node's driver — NVIDIA's ``libcuda.so.1`` where one is installed, else
fakegpu's fake one: it launches one kernel through ``dlopen`` + ``dlsym(handle)``
(how ctypes and Triton reach the driver) and one through ``cuGetProcAddress_v2``
(how the CUDA runtime since 11.3 does), and reads the interposer's own named
counters.  On the real driver the kernel is an empty PTX kernel (JIT-compiled
by the driver).  Direct linking and ``RTLD_LOCAL`` callers are covered by the
test suite (they need a compiled program).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from typing import Any

# An empty kernel every NVIDIA driver with PTX ISA 7.0 (CUDA 11.0+) can JIT for its GPU.
NOP_PTX = (".version 7.0\n.target sm_50\n.address_size 64\n"
           ".visible .entry krex_nop()\n{\n\tret;\n}\n")

PROGRAM = r"""
import ctypes, json, os
lib = ctypes.CDLL(os.environ.get("KREX_SELFTEST_DRIVER", "libcuda.so.1"))
ok = lambda rc: rc == 0 or (_ for _ in ()).throw(SystemExit(f"driver error {rc}"))
ok(lib.cuInit(0))
dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
ok(lib.cuDeviceGet(ctypes.byref(dev), 0))
ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)); ok(lib.cuCtxSetCurrent(ctx))
ok(lib.cuModuleLoadData(ctypes.byref(mod), os.environ["KREX_SELFTEST_IMAGE"].encode() + b"\0"))
ok(lib.cuModuleGetFunction(ctypes.byref(fn), mod, os.environ["KREX_SELFTEST_KERNEL"].encode()))
args = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, None, None)
ok(lib.cuLaunchKernel(fn, *args))                                   # dlsym(handle)
ptr = ctypes.c_void_p()
ok(lib.cuGetProcAddress_v2(b"cuLaunchKernel", ctypes.byref(ptr), 12000, 0, None))
proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 6, ctypes.c_uint,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
ok(proto(ptr.value)(fn, *args))                                     # cuGetProcAddress
ok(lib.cuCtxSynchronize())
from krex.devices.native import interposer_counters
me = ctypes.CDLL(os.environ["KREX_SELFTEST_INTERPOSER"])
c = interposer_counters(me)
print(json.dumps({"active": me.krex_interposer_active(), "dlsym": c["launch_dlsym"],
                  "getprocaddress": c["launch_getproc"], "direct": c["launch_direct"],
                  "unmatched": c["unmatched"], "unwrapped": c["unwrapped"],
                  "hooks": me.krex_interposer_hook_count()}))
"""


def real_driver() -> str | None:
    """NVIDIA's driver library if it can be loaded here (no GPU call is made)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return "libcuda.so.1"


def interposer_selftest(gate_path: str, timeout_s: float = 30.0,
                        driver: str | None = None) -> dict[str, Any]:
    """Run the self-test; ``{"ok": bool, "detail": str, "driver": ..., ...counts}``.

    ``gate_path`` is an open gate file the caller made (gate files are
    :mod:`krex.enforce`'s: ``krex.enforce.doctor`` makes one).  ``driver``: a
    driver library to test against (default: the real one when present, else
    fakegpu).
    """
    from krex.devices.native import check_interposer
    from krex.errors import KrexError

    try:
        lib = check_interposer()
    except KrexError as exc:
        return {"ok": False, "detail": exc.message}
    driver = driver or real_driver()
    if driver is not None:
        env = {"KREX_SELFTEST_DRIVER": driver, "KREX_SELFTEST_IMAGE": NOP_PTX,
               "KREX_SELFTEST_KERNEL": "krex_nop"}
        return _run(lib, gate_path, env, driver, timeout_s)
    from krex.devices import fakegpu

    if not fakegpu.available():
        return {"ok": False, "detail": "no CUDA driver and fakegpu was not built: "
                                       "nothing to test against"}
    with fakegpu.FakeGpu() as gpu:
        env = {**gpu.env(), "KREX_SELFTEST_IMAGE": "fake", "KREX_SELFTEST_KERNEL": "spin_us_10"}
        return _run(lib, gate_path, env, "fakegpu", timeout_s)


def _run(lib: Any, gate_path: str, extra: dict[str, str], driver: str,
         timeout_s: float) -> dict[str, Any]:
    from krex.devices.native import preload_env

    env = preload_env(gate_path, 0, base=None) | extra
    env["KREX_SELFTEST_INTERPOSER"] = str(lib)
    try:
        done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "driver": driver, "detail": f"self-test on {driver} timed out"}
    if done.returncode != 0:
        return {"ok": False, "driver": driver,
                "detail": f"self-test program on {driver} failed: {done.stderr.strip()[-300:]}"}
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    ok = counts["active"] == 1 and counts["dlsym"] >= 1 and counts["getprocaddress"] >= 1
    detail = (f"{driver}: {counts['hooks']} hooked symbols; launches caught via dlsym "
              f"{counts['dlsym']}, cuGetProcAddress {counts['getprocaddress']}; "
              f"unwrapped {counts['unwrapped']} (unmatched {counts['unmatched']})")
    clean = counts["unmatched"] == counts["unwrapped"] == 0
    return {"ok": ok and clean, "driver": driver, "detail": detail, **counts}
