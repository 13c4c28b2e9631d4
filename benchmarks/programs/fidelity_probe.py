"""The measured job of the fidelity benchmark: times kernels of ~0.1, 1 and 10 ms.

argv: DEVICE OUT_JSON SIZES_JSON
cpu: compute-bound (an integer-hash loop) and memory-bound (memcpy) kernels in C,
compiled once with cc and called through ctypes; the copy walks a 256 MiB ring,
8x the last-level cache, so every size streams from DRAM (a 1 ms copy of a
resident 12 MiB buffer would sit at the cache-capacity cliff, where what other
tenants of the host cache decides its speed);
fakegpu:0: spin_us_N kernels timed with device events.  Each kernel is timed
by krex.measure, whose region covers the timed loop only.
"""

import json
import sys
import time

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
RING_BYTES = 256 << 20


C_SOURCE = r"""
#include <stddef.h>
#include <string.h>
unsigned long compute(unsigned long n) {
    unsigned long x = 1;
    for (unsigned long i = 0; i < n; i++) x = (x * 6364136223846793005ul + i) ^ (x >> 17);
    return x;
}
void copy_ring(char *dst, const char *src, size_t ring, size_t n, size_t *off) {
    if (*off + n > ring) *off = 0;
    memcpy(dst + *off, src + *off, n);
    *off += n;
}
"""


def _c_library():
    """Compiled kernels: no interpreter between the timer and the work."""
    import ctypes
    import hashlib
    import os
    import subprocess
    import tempfile

    tag = hashlib.sha1(C_SOURCE.encode()).hexdigest()[:12]
    lib = os.path.join(tempfile.gettempdir(), f"krex-fidelity-{tag}.so")
    if not os.path.exists(lib):
        src = lib[:-3] + ".c"
        with open(src, "w") as f:
            f.write(C_SOURCE)
        tmp = f"{lib}.{os.getpid()}"
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", tmp, src], check=True)
        os.replace(tmp, lib)
    c = ctypes.CDLL(lib)
    c.compute.argtypes, c.compute.restype = [ctypes.c_ulong], ctypes.c_ulong
    c.copy_ring.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                            ctypes.POINTER(ctypes.c_size_t)]
    return c


def cpu_kernels():
    import ctypes

    c = _c_library()

    def compute(n):
        return lambda: c.compute(n)

    src = ctypes.create_string_buffer(RING_BYTES)  # zero-filled: every page touched
    dst = ctypes.create_string_buffer(RING_BYTES)

    def memory(nbytes):
        nbytes = min(nbytes, RING_BYTES)
        off = ctypes.c_size_t(0)
        return lambda: c.copy_ring(dst, src, RING_BYTES, nbytes, ctypes.byref(off))

    ks = {}
    for ms in BUCKETS_MS:
        for kind, make, start in (("compute", compute, 10000), ("memory", memory, 1 << 16)):
            name = f"{kind}-{ms:g}ms"
            if name not in SIZES:
                SIZES[name] = _calibrate(make, ms, start)
            ks[name] = (ms, make(SIZES[name]))
    return ks, None


def _calibrate(make, target_ms, start):
    n = start
    while True:
        k = make(n)
        k()
        t0 = time.perf_counter()
        for _ in range(3):
            k()
        took = (time.perf_counter() - t0) / 3 * 1e3
        if took >= target_ms * 0.9 or n > 1 << 30:
            return max(1, int(n * target_ms / max(took, 1e-6)))
        n = int(n * (2 if took < target_ms / 4 else max(1.1, target_ms / took)))


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


kernels, timer = gpu_kernels() if device.startswith("fakegpu") else cpu_kernels()
results = {}
for name, (ms, fn) in kernels.items():
    m = krex.measure(fn, device=device, timer=timer, cache="hot", warmup_ms=max(5, 3 * ms),
                     min_time_s=max(0.15, 30 * ms / 1e3), max_time_s=max(0.3, 40 * ms / 1e3),
                     timeout_s=10, retries=0, noise_target=0.0)
    results[name] = {"bucket_ms": ms, "samples_ms": m.samples_ms,
                     "clean": m.region.get("clean"), "held_s": m.region.get("held_s")}
with open(out, "w") as f:
    json.dump(results, f)
with open(sizes_path, "w") as f:
    json.dump(SIZES, f)
