"""CPU kernels in C for the fidelity and floor benchmarks, called through ctypes.

compute: an integer-hash loop (ALU only).  memory: memcpy walking a 256 MiB
ring, 8x the last-level cache, so every size streams from DRAM (a 1 ms copy
of a resident 12 MiB buffer would sit at the cache-capacity cliff, where what
other tenants of the host's cache do decides its speed).  Compiled once per
source text with cc into the temp directory.
"""

import ctypes
import hashlib
import os
import subprocess
import tempfile
import time

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


def cpu_kernels(buckets_ms, sizes):
    """{name: (bucket_ms, fn)}; ``sizes`` (name -> n) is filled in by calibration."""
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
    for ms in buckets_ms:
        for kind, make, start in (("compute", compute, 10000), ("memory", memory, 1 << 16)):
            name = f"{kind}-{ms:g}ms"
            if name not in sizes:
                sizes[name] = _calibrate(make, ms, start)
            ks[name] = (ms, make(sizes[name]))
    return ks


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
