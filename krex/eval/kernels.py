"""The kernels a command checks and times, per device.

A kernel is described by a :class:`KernelSpec` (plain data, sent to every
command) and built inside the command by :func:`build`, which returns a
zero-argument callable:

- ``cpu``: ``compute`` is a single-threaded numpy matrix product of side
  ``size``, ``memory`` a numpy copy of ``size`` bytes.  Sizes are calibrated
  once per run (:func:`calibrate_cpu`) so each kernel lands in its bucket.
- ``fakegpu``: ``spin`` launches fakegpu's ``spin_us_N`` kernel through the
  driver API (``cuLaunchKernel``); ``size`` is N.
- ``cuda:N``: ``spin`` launches :data:`DEVICE_PTX`'s ``krex_spin_ns`` through the
  driver API: it busy-waits ``size`` µs of the GPU's own global timer
  (``%globaltimer``), so it needs no calibration; the driver JIT-compiles the PTX
  for whatever GPU it finds.
- ``rocm:N``: ``sleep`` runs ``torch.cuda._sleep`` (a ROCm build of torch) for a
  number of cycles calibrated once per command to ``size`` µs.
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


# Kernels on the device's global timer (ns), for any NVIDIA GPU the driver can JIT for:
# krex_spin_ns(u64 ns) busy-waits; krex_stamp(u64 *out, u64 ns) also writes its start and
# end stamps to out[0], out[1] (benchmarks/gpu_check.py judges overlap by them).
DEVICE_PTX = b"""
.version 7.0
.target sm_50
.address_size 64

.func krex_spin(.param .u64 ns, .param .u64 out)
{
    .reg .pred %p<3>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [ns];
    ld.param.u64 %rd5, [out];
    mov.u64 %rd2, %globaltimer;
SPIN:
    mov.u64 %rd3, %globaltimer;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra SPIN;
    setp.eq.u64 %p2, %rd5, 0;
    @%p2 bra DONE;
    st.global.u64 [%rd5], %rd2;
    st.global.u64 [%rd5+8], %rd3;
    membar.sys;
DONE:
    ret;
}

.visible .entry krex_spin_ns(.param .u64 krex_spin_ns_param)
{
    .reg .b64 %rd<2>;
    ld.param.u64 %rd1, [krex_spin_ns_param];
    {
    .param .u64 a;
    .param .u64 b;
    st.param.u64 [a], %rd1;
    st.param.u64 [b], 0;
    call.uni krex_spin, (a, b);
    }
    ret;
}

.visible .entry krex_stamp(.param .u64 krex_stamp_out, .param .u64 krex_stamp_ns)
{
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [krex_stamp_ns];
    ld.param.u64 %rd2, [krex_stamp_out];
    cvta.to.global.u64 %rd3, %rd2;
    {
    .param .u64 a;
    .param .u64 b;
    st.param.u64 [a], %rd1;
    st.param.u64 [b], %rd3;
    call.uni krex_spin, (a, b);
    }
    ret;
}
"""


def build(spec: KernelSpec, device: str, lib: Any = None) -> Callable[[], Any]:
    """A callable running ``spec`` once on ``device`` (``lib``: the CUDA driver, real or
    fakegpu's)."""
    if spec.kind == "spin":
        if device.startswith("cuda"):
            return _ptx_spin(lib, spec.size * 1000)
        return _fakegpu_kernel(lib, spec.size)
    if spec.kind == "sleep":
        return _torch_sleep(device, spec.size)
    import numpy as np

    if spec.kind == "compute":
        a = np.random.default_rng(0).random((spec.size, spec.size))
        b = a.T.copy()
        return lambda: a @ b
    src = np.ones(max(1, spec.size // 8))
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def _launcher(lib: Any, image: Any, name: str, params: Any = None) -> Callable[[], None]:
    """A callable launching kernel ``name`` of module ``image`` (1 thread, default stream)."""
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    if lib.cuModuleLoadData(ctypes.byref(mod), image) != 0:
        raise RuntimeError("cuModuleLoadData failed: the driver cannot load the module")
    if lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()) != 0:
        raise RuntimeError(f"cuModuleGetFunction({name}) failed")
    args = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, params, None)

    def launch() -> None:
        if lib.cuLaunchKernel(fn, *args) != 0:
            raise RuntimeError("cuLaunchKernel failed")

    launch.keep = (image, params)  # type: ignore[attr-defined]
    return launch


def _fakegpu_kernel(lib: Any, us: int) -> Callable[[], None]:
    return _launcher(lib, b"krex-eval", f"spin_us_{us}")


def _ptx_spin(lib: Any, ns: int) -> Callable[[], None]:
    arg = ctypes.c_uint64(ns)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(arg), ctypes.c_void_p))
    launch = _launcher(lib, ctypes.create_string_buffer(DEVICE_PTX), "krex_spin_ns", params)
    launch.arg = arg  # type: ignore[attr-defined]  # kept alive with the launcher
    return launch


def _torch_sleep(device: str, us: int) -> Callable[[], None]:
    import torch

    index = int(device.partition(":")[2] or 0)
    torch.cuda.set_device(index)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 1_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_us = cycles / max(start.elapsed_time(end) * 1e3, 1e-3)
    n = max(1, int(per_us * us))
    return lambda: torch.cuda._sleep(n)


def device_specs(device: str, buckets_ms: tuple[float, ...],
                 twins_ms: tuple[float, ...] = (), ratio: float = 1.03) -> list[KernelSpec]:
    """The kernels of a GPU device (fakegpu, cuda:N: ``spin``; rocm:N: ``sleep``), one per
    bucket, ``size`` in µs; plus a twin ``ratio`` x as long in each bucket of ``twins_ms``."""
    kind = "sleep" if device.startswith("rocm") else "spin"
    specs = [KernelSpec(f"{kind}-{b:g}ms", kind, b, int(round(b * 1000))) for b in buckets_ms]
    return specs + [twin(k, ratio) for k in specs if k.bucket_ms in twins_ms]


def twin(spec: KernelSpec, ratio: float) -> KernelSpec:
    """The same kernel made ``ratio`` x as long (work scales with side³ for ``compute``):
    a candidate whose true time differs from ``spec``'s by a few per cent."""
    scale = ratio ** (1 / 3) if spec.kind == "compute" else ratio
    size = max(spec.size + 1, int(round(spec.size * scale)))
    return KernelSpec(f"{spec.name}+{round((ratio - 1) * 100):g}%", spec.kind, spec.bucket_ms,
                      size)


def fakegpu_specs(buckets_ms: tuple[float, ...]) -> list[KernelSpec]:
    return device_specs("fakegpu:0", buckets_ms)


def calibrate_cpu(buckets_ms: tuple[float, ...], kinds: tuple[str, ...],
                  twins_ms: tuple[float, ...] = (), ratio: float = 1.03) -> list[KernelSpec]:
    """Sizes whose median run time alone is about each bucket's duration (and the twins
    of those in ``twins_ms``, see :func:`twin`)."""
    specs = [KernelSpec(f"{k}-{b:g}ms", k, b, _size_for(k, b)) for k in kinds for b in buckets_ms]
    return specs + [twin(k, ratio) for k in specs if k.bucket_ms in twins_ms]


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
