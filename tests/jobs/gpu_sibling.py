"""A fakegpu sibling: keeps a deep queue of 5 ms kernels on its own context.

argv: BATCH   Prints "batch N" each time it has queued a batch.
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
n = 0
while True:
    for _ in range(batch):
        ok(lib.cuLaunchKernel(fn, *args))
    n += 1
    print(f"batch {n}", flush=True)
    ok(lib.cuCtxSynchronize())
