"""The measured job of the fidelity benchmark: times kernels of ~0.1, 1 and 10 ms.

argv: DEVICE OUT_JSON SIZES_JSON
cpu: compute-bound and memory-bound kernels in C (ckernels.py);
fakegpu:0: spin_us_N kernels timed with device events.  Each kernel is timed
by krex.measure, whose region covers the timed loop only.
"""

import json
import sys

import krex

device, out, sizes_path = sys.argv[1], sys.argv[2], sys.argv[3]
# Kernel sizes are calibrated once (by the first run) and reused by every run,
# so that the alone and the loaded runs time the very same kernels.
try:
    with open(sizes_path) as f:
        SIZES = json.load(f)
except FileNotFoundError:
    SIZES = {}
BUCKETS_MS = (0.1, 1.0, 10.0)


def gpu_kernels():
    import ctypes

    from krex.measure.events import FakegpuTimer

    timer = FakegpuTimer(0)
    lib = timer.api.lib
    mod = ctypes.c_void_p()
    lib.cuModuleLoadData(ctypes.byref(mod), b"fake")
    args = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, None, None)
    ks = {}
    for ms in BUCKETS_MS:
        fn = ctypes.c_void_p()
        lib.cuModuleGetFunction(ctypes.byref(fn), mod, f"spin_us_{int(ms * 1000)}".encode())
        ks[f"spin-{ms:g}ms"] = (ms, lambda fn=fn: lib.cuLaunchKernel(fn, *args))
    return ks, timer


if device.startswith("fakegpu"):
    kernels, timer = gpu_kernels()
else:
    from ckernels import cpu_kernels  # beside this file

    kernels, timer = cpu_kernels(BUCKETS_MS, SIZES), None
results = {}
for name, (ms, fn) in kernels.items():
    m = krex.measure(fn, device=device, timer=timer, cache="hot", warmup_ms=max(5, 3 * ms),
                     min_time_s=max(0.15, 30 * ms / 1e3), max_time_s=max(0.3, 40 * ms / 1e3),
                     timeout_s=10, retries=0, noise_target=0.0)
    results[name] = {"bucket_ms": ms, "samples_ms": m.samples_ms,
                     "clean": m.region.clean, "held_s": m.region.held_s}
with open(out, "w") as f:
    json.dump(results, f)
with open(sizes_path, "w") as f:
    json.dump(SIZES, f)
