"""A fakegpu sibling: keeps a deep queue of 5 ms kernels on its own context.

argv: BATCH [future]   Prints "batch N" each time it has queued a batch.
"future": launches through the cuLaunchKernel that cuGetProcAddress hands a caller
of a CUDA newer than krex's tables (fakegpu's driver returns another entry point):
the interposer cannot tell its variant and leaves it unwrapped.
"""

import ctypes
import sys

lib = ctypes.CDLL("libcuda.so.1")
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 100


def ok(rc):
    if rc != 0:
        raise SystemExit(f"driver error {rc}")


ok(lib.cuInit(0))
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ok(lib.cuDeviceGet(ctypes.byref(dev), 0))
ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
ok(lib.cuCtxSetCurrent(ctx))
mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
ok(lib.cuModuleLoadData(ctypes.byref(mod), b"fake"))
ok(lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin_us_5000"))
args = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, None, None)
launch = lib.cuLaunchKernel
if sys.argv[2:] == ["future"]:
    ptr = ctypes.c_void_p()
    ok(lib.cuGetProcAddress_v2(b"cuLaunchKernel", ctypes.byref(ptr), 13010, 0, None))
    launch = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(ptr.value)
n = 0
while True:
    for _ in range(batch):
        ok(launch(fn, *args))
    n += 1
    print(f"batch {n}", flush=True)
    ok(lib.cuCtxSynchronize())
