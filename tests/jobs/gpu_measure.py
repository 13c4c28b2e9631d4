"""A fakegpu holder: measures a 1 ms kernel with device events inside a region.

Prints JSON {"median_ms", "p10_ms", "clean", "report"} or {"error", "message"}.
"""

import ctypes
import json

import krex
from krex.errors import KrexError
from krex.measure.events import FakegpuTimer

timer = FakegpuTimer(0)
lib = timer.api.lib
mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
assert lib.cuModuleLoadData(ctypes.byref(mod), b"fake") == 0
assert lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin_us_1000") == 0
args = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, None, None)


def kernel():
    assert lib.cuLaunchKernel(fn, *args) == 0


try:
    m = krex.measure(kernel, timer=timer, device="fakegpu:0", warmup_ms=5, min_time_s=0.15,
                     max_time_s=0.3, timeout_s=10, retries=0)
    low = sorted(m.samples_ms)[len(m.samples_ms) // 10]  # the 10th percentile
    print(json.dumps({"median_ms": m.median_ms, "p10_ms": low, "clean": m.region.clean,
                      "report": m.region.to_dict()}))
except KrexError as exc:
    print(json.dumps({"error": exc.code, "message": exc.message}))
