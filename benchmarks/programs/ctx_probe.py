"""Context-creation probe of gpu_check.py: how long until a fresh process has a context.

argv: DEVICE MODE   (MODE: driver | torch)
Prints one JSON line of CLOCK_MONOTONIC timestamps (s): ``start`` (first line of the
script), ``imported`` (ctypes or torch imported), ``init`` (cuInit / torch.cuda.init()),
``ready`` (primary context retained and current / first tensor on the device).
The parent compares them with its own monotonic time at spawn.
"""

import time

T_START = time.monotonic()
import json  # noqa: E402
import sys  # noqa: E402

device, mode = sys.argv[1], sys.argv[2]
index = int(device.partition(":")[2] or 0)
if mode == "torch":
    import torch

    t_imported = time.monotonic()
    torch.cuda.init()
    t_init = time.monotonic()
    torch.zeros(1, device=f"cuda:{index}")
    torch.cuda.synchronize()
    t_ready = time.monotonic()
else:
    import ctypes

    t_imported = time.monotonic()
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.cuInit(0) == 0, "cuInit failed"
    t_init = time.monotonic()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert lib.cuDeviceGet(ctypes.byref(dev), index) == 0, "cuDeviceGet failed"
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0, "ctx retain failed"
    assert lib.cuCtxSetCurrent(ctx) == 0, "cuCtxSetCurrent failed"
    t_ready = time.monotonic()
print(json.dumps({"start": T_START, "imported": t_imported, "init": t_init, "ready": t_ready}))
