"""The compile phase: a real ``cc -O2`` run on generated C source.

``source(n_funcs)`` writes a translation unit of ``n_funcs`` small numeric
functions; ``calibrate(target_ms)`` finds the size whose compilation takes
about ``target_ms`` alone on this machine; ``compile_once(n_funcs, workdir)``
is what a command does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

CC = os.environ.get("CC") or shutil.which("cc") or "cc"


def source(n_funcs: int, seed: int = 0) -> str:
    """C source with ``n_funcs`` loops the optimiser has to work on."""
    parts = ["#include <stddef.h>\n"]
    for i in range(n_funcs):
        k = (i + seed) % 7 + 2
        parts.append(
            f"double k{i}(const double *a, double *b, size_t n) {{\n"
            f"  double acc = {i}.0;\n"
            f"  for (size_t j = 0; j + {k} < n; ++j) {{\n"
            f"    b[j] = a[j] * {k}.5 + a[j + {k}] / (1.0 + acc);\n"
            f"    acc += b[j] * (j % {k} ? 0.5 : 1.5);\n"
            f"  }}\n  return acc;\n}}\n"
        )
    return "".join(parts)


def compile_once(n_funcs: int, workdir: str | None = None, seed: int = 0) -> float:
    """Compile ``n_funcs`` functions to an object file; return the wall seconds."""
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="krex-eval-cc-")
    src, obj = os.path.join(workdir, "kernel.c"), os.path.join(workdir, "kernel.o")
    try:
        with open(src, "w") as f:
            f.write(source(n_funcs, seed))
        t0 = time.perf_counter()
        subprocess.run([CC, "-O2", "-c", src, "-o", obj], check=True,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        return time.perf_counter() - t0
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def calibrate(target_ms: float, probe_funcs: int = 60) -> int:
    """Number of functions whose compilation takes about ``target_ms`` here, alone."""
    if target_ms <= 0:
        return 0
    compile_once(1)  # warm the compiler's files into the page cache
    small = min(compile_once(1) for _ in range(2))
    probe = min(compile_once(probe_funcs) for _ in range(2))
    per_func_s = max((probe - small) / probe_funcs, 1e-5)
    return max(1, round((target_ms / 1e3 - small) / per_func_s))
