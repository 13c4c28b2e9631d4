"""Interposer self-test: which ways of reaching the driver are caught here.

Runs a tiny program with the interposer preloaded against the node's driver
(fakegpu's fake ``libcuda.so.1`` where there is no GPU): it launches one
kernel through ``dlopen`` + ``dlsym(handle)`` (how ctypes and Triton reach
the driver) and one through ``cuGetProcAddress_v2`` (how the CUDA runtime
since 11.3 does), and reads the interposer's own per-path launch counters.
Direct linking is covered by the test suite (it needs a compiled program).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

PROGRAM = r"""
import ctypes, json, os
lib = ctypes.CDLL("libcuda.so.1")
ok = lambda rc: rc == 0 or (_ for _ in ()).throw(SystemExit(f"driver error {rc}"))
ok(lib.cuInit(0))
dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
ok(lib.cuDeviceGet(ctypes.byref(dev), 0))
ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)); ok(lib.cuCtxSetCurrent(ctx))
ok(lib.cuModuleLoadData(ctypes.byref(mod), b"fake"))
ok(lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin_us_10"))
args = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, None, None)
ok(lib.cuLaunchKernel(fn, *args))                                   # dlsym(handle)
ptr = ctypes.c_void_p()
ok(lib.cuGetProcAddress_v2(b"cuLaunchKernel", ctypes.byref(ptr), 12000, 0, None))
proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 6, ctypes.c_uint,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
ok(proto(ptr.value)(fn, *args))                                     # cuGetProcAddress
ok(lib.cuCtxSynchronize())
me = ctypes.CDLL(os.environ["KREX_SELFTEST_INTERPOSER"])
counts = (ctypes.c_uint64 * 6)()
me.krex_interposer_counts(counts, 6)
print(json.dumps({"active": me.krex_interposer_active(), "dlsym": counts[1],
                  "getprocaddress": counts[2], "direct": counts[0], "unmatched": counts[5],
                  "hooks": me.krex_interposer_hook_count()}))
"""


def interposer_selftest(gate_path: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Run the self-test on fakegpu; ``{"ok": bool, "detail": str, ...counts}``.

    ``gate_path`` is an open gate file the caller made (gate files are
    :mod:`krex.enforce`'s: ``krex.enforce.doctor`` makes one).
    """
    from krex.devices import fakegpu
    from krex.devices.native import check_interposer, preload_env
    from krex.errors import KrexError

    try:
        lib = check_interposer()
    except KrexError as exc:
        return {"ok": False, "detail": exc.message}
    if not fakegpu.available():
        return {"ok": False, "detail": "fakegpu was not built: nothing to test against"}
    with fakegpu.FakeGpu() as gpu:
        env = preload_env(gate_path, 0, base=gpu.env())
        env["KREX_SELFTEST_INTERPOSER"] = str(lib)
        done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    if done.returncode != 0:
        return {"ok": False, "detail": f"self-test program failed: {done.stderr.strip()[-300:]}"}
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    ok = counts["active"] == 1 and counts["dlsym"] >= 1 and counts["getprocaddress"] >= 1
    detail = (f"{counts['hooks']} hooked symbols; launches caught via dlsym {counts['dlsym']}, "
              f"cuGetProcAddress {counts['getprocaddress']}; unmatched {counts['unmatched']}")
    return {"ok": ok and counts["unmatched"] == 0, "detail": detail, **counts}
