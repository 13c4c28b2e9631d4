"""The kernels a command checks and times, per device.

A kernel is described by a :class:`KernelSpec` (plain data, sent to every
command) and built inside the command by :func:`build`, which returns a
zero-argument callable:

- ``cpu``: ``compute`` is a single-threaded numpy matrix product of side
  ``size``, ``memory`` a numpy copy of ``size`` bytes.  Sizes are calibrated
  once per run (:func:`calibrate_cpu`) so each kernel lands in its bucket.
- ``fakegpu``: ``spin`` launches fakegpu's ``spin_us_N`` kernel through the
  driver API (``cuLaunchKernel``); ``size`` is N.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core per kernel: the device is one core


@dataclass(frozen=True)
class KernelSpec:
    name: str  # e.g. "compute-1ms"
    kind: str  # compute | memory | spin
    bucket_ms: float  # nominal duration: 0.1, 1 or 10
    size: int  # matrix side, bytes, or microseconds

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build(spec: KernelSpec, device: str, lib: Any = None) -> Callable[[], Any]:
    """A callable running ``spec`` once on ``device`` (``lib``: the driver for fakegpu)."""
    if spec.kind == "spin":
        return _fakegpu_kernel(lib, spec.size)
    import numpy as np

    if spec.kind == "compute":
        a = np.random.default_rng(0).random((spec.size, spec.size))
        b = a.T.copy()
        return lambda: a @ b
    src = np.ones(max(1, spec.size // 8))
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def _fakegpu_kernel(lib: Any, us: int) -> Callable[[], None]:
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    if lib.cuModuleLoadData(ctypes.byref(mod), b"krex-eval") != 0:
        raise RuntimeError("cuModuleLoadData failed")
    if lib.cuModuleGetFunction(ctypes.byref(fn), mod, f"spin_us_{us}".encode()) != 0:
        raise RuntimeError(f"cuModuleGetFunction(spin_us_{us}) failed")
    args = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, None, None)

    def launch() -> None:
        if lib.cuLaunchKernel(fn, *args) != 0:
            raise RuntimeError("cuLaunchKernel failed")

    return launch


def fakegpu_specs(buckets_ms: tuple[float, ...]) -> list[KernelSpec]:
    return [KernelSpec(f"spin-{b:g}ms", "spin", b, int(round(b * 1000))) for b in buckets_ms]


def calibrate_cpu(buckets_ms: tuple[float, ...], kinds: tuple[str, ...]) -> list[KernelSpec]:
    """Sizes whose median run time alone is about each bucket's duration."""
    return [KernelSpec(f"{k}-{b:g}ms", k, b, _size_for(k, b)) for k in kinds for b in buckets_ms]


def _size_for(kind: str, target_ms: float) -> int:
    size = 64 if kind == "compute" else 1 << 16
    for _ in range(8):
        ms = _median_ms(build(KernelSpec("probe", kind, target_ms, size), "cpu"))
        scale = target_ms / max(ms, 1e-4)
        if 0.9 < scale < 1.1:
            break
        size = max(8, int(size * (scale ** (1 / 3) if kind == "compute" else scale)))
    return size


def _median_ms(fn: Callable[[], Any], n: int = 15) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[n // 2]


def check_work(kernels: list[Callable[[], Any]], budget_ms: float) -> int:
    """The untimed correctness check: run the kernels round-robin for ``budget_ms``."""
    end = time.perf_counter() + budget_ms / 1e3
    calls = 0
    while time.perf_counter() < end or calls == 0:
        kernels[calls % len(kernels)]()
        calls += 1
    return calls
