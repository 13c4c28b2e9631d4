"""The CUDA driver API through ctypes: a spin kernel of a chosen duration, on a GPU or fakegpu.

Used by the programs of ``benchmarks/gpu_check.py``; needs no Python package.
On a real GPU the kernels come from the embedded PTX below (JIT-compiled by the
driver): ``krex_noop`` (empty) and ``krex_spin(u64 cycles)`` (busy-waits on
``%clock64``; cycles per ms are calibrated with driver events).  On fakegpu
the fake driver's conventions are used: ``spin_ns_N`` kernels, any module data.
"""

from __future__ import annotations

import ctypes
import os
import statistics

PTX = rb"""
.version 7.0
.target sm_80
.address_size 64

.visible .entry krex_noop()
{
    ret;
}

.visible .entry krex_spin(.param .u64 krex_spin_param_0)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [krex_spin_param_0];
    mov.u64 %rd2, %clock64;
LOOP:
    mov.u64 %rd3, %clock64;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra LOOP;
    ret;
}
"""
CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13
CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2
LAUNCH_ARGTYPES = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3


def parse_device(device: str) -> tuple[str, int]:
    kind, _, index = device.partition(":")
    return kind, int(index or 0)


def library_path(device: str) -> str:
    if parse_device(device)[0] == "fakegpu":
        explicit = os.environ.get("KREX_FAKEGPU_LIB")
        if explicit:
            return explicit
        try:
            from krex.devices.native import fakegpu_lib_dir

            return str(fakegpu_lib_dir() / "libcuda.so.1")
        except ImportError:
            pass
    return "libcuda.so.1"


class DriverError(RuntimeError):
    pass


class Driver:
    """The primary context of one device, a loaded module and launch helpers."""

    def __init__(self, device: str, lib: ctypes.CDLL | None = None) -> None:
        self.device = device
        kind, self.index = parse_device(device)
        self.fake = kind == "fakegpu"
        self.lib = lib or ctypes.CDLL(library_path(device))
        self.check("cuInit", self.lib.cuInit(0))
        self.dev = ctypes.c_int()
        self.check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(self.dev), self.index))
        self.ctx = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain",
                   self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), self.dev))
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self.ctx))
        self.module = ctypes.c_void_p()
        image = b"fake" if self.fake else PTX + b"\0"
        self._image = ctypes.create_string_buffer(image)
        self.check("cuModuleLoadData",
                   self.lib.cuModuleLoadData(ctypes.byref(self.module), self._image))
        self._keep: list = []
        self.cycles_per_ms: float | None = None

    def check(self, what: str, rc: int) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            try:
                self.lib.cuGetErrorName(rc, ctypes.byref(name))
            except Exception:  # noqa: BLE001, S110 - the name is a nicety; rc is reported
                pass
            raise DriverError(f"{what} failed: {rc} {(name.value or b'').decode()}")

    def function(self, name: str) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        self.check(f"cuModuleGetFunction({name})",
                   self.lib.cuModuleGetFunction(ctypes.byref(fn), self.module, name.encode()))
        return fn

    # -- launches -------------------------------------------------------------------

    def noop_function(self) -> ctypes.c_void_p:
        return self.function("spin_us_10" if self.fake else "krex_noop")

    def launch(self, fn: ctypes.c_void_p, params=None, launcher=None) -> None:
        launcher = launcher or self.lib.cuLaunchKernel
        self.check("cuLaunchKernel", launcher(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None))

    def getproc_launcher(self, per_thread_stream: bool = False):
        """cuLaunchKernel as the CUDA runtime gets it: through cuGetProcAddress_v2."""
        ptr = ctypes.c_void_p()
        flags = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM if per_thread_stream else 0
        get = getattr(self.lib, "cuGetProcAddress_v2", None)
        if get is not None:
            status = ctypes.c_int()
            rc = get(b"cuLaunchKernel", ctypes.byref(ptr), 12000, ctypes.c_uint64(flags),
                     ctypes.byref(status))
        else:
            rc = self.lib.cuGetProcAddress(b"cuLaunchKernel", ctypes.byref(ptr), 12000,
                                           ctypes.c_uint64(flags))
        self.check("cuGetProcAddress(cuLaunchKernel)", rc)
        proto = ctypes.CFUNCTYPE(ctypes.c_int, *LAUNCH_ARGTYPES)
        return proto(ptr.value)

    def spin(self, ms: float):
        """A zero-argument callable launching one kernel of about ``ms`` on the default stream."""
        if self.fake:
            fn = self.function(f"spin_ns_{max(1, int(ms * 1e6))}")
            return lambda: self.launch(fn)
        if self.cycles_per_ms is None:
            self.calibrate()
        fn = self.function("krex_spin")
        cycles = ctypes.c_uint64(int(ms * self.cycles_per_ms))
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(cycles), ctypes.c_void_p))
        self._keep.append((cycles, params))
        return lambda: self.launch(fn, params)

    def synchronize(self) -> None:
        self.check("cuCtxSynchronize", self.lib.cuCtxSynchronize())

    # -- timing ---------------------------------------------------------------------

    def event(self) -> ctypes.c_void_p:
        ev = ctypes.c_void_p()
        self.check("cuEventCreate", self.lib.cuEventCreate(ctypes.byref(ev), 0))
        return ev

    def time_ms(self, fn, reps: int = 1) -> float:
        a, b = self.event(), self.event()
        self.check("cuEventRecord", self.lib.cuEventRecord(a, None))
        for _ in range(reps):
            fn()
        self.check("cuEventRecord", self.lib.cuEventRecord(b, None))
        self.check("cuEventSynchronize", self.lib.cuEventSynchronize(b))
        ms = ctypes.c_float()
        elapsed = getattr(self.lib, "cuEventElapsedTime_v2", None) or self.lib.cuEventElapsedTime
        self.check("cuEventElapsedTime", elapsed(ctypes.byref(ms), a, b))
        return float(ms.value) / reps

    def calibrate(self) -> float:
        """Cycles of ``krex_spin`` per ms of device time (median of a few 5 ms probes)."""
        if self.fake:
            self.cycles_per_ms = 1e6
            return self.cycles_per_ms
        khz = ctypes.c_int()
        self.lib.cuDeviceGetAttribute(ctypes.byref(khz), CU_DEVICE_ATTRIBUTE_CLOCK_RATE, self.dev)
        guess = float(khz.value or 1_500_000)
        fn = self.function("krex_spin")
        ratios = []
        for _ in range(5):
            cycles = ctypes.c_uint64(int(5 * guess))
            params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(cycles), ctypes.c_void_p))
            took = self.time_ms(lambda p=params: self.launch(fn, p))
            ratios.append(cycles.value / max(took, 1e-6))
        self.cycles_per_ms = statistics.median(ratios[1:])
        return self.cycles_per_ms
