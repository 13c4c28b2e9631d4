"""A fakegpu sibling for the fidelity benchmark: keeps 2 ms kernels queued, forever."""

import ctypes

lib = ctypes.CDLL("libcuda.so.1")
lib.cuInit(0)
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
lib.cuDeviceGet(ctypes.byref(dev), 0)
lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
lib.cuCtxSetCurrent(ctx)
mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
lib.cuModuleLoadData(ctypes.byref(mod), b"fake")
lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin_us_2000")
args = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, None, None)
print("running", flush=True)
while True:
    for _ in range(20):
        lib.cuLaunchKernel(fn, *args)
    lib.cuCtxSynchronize()
