"""The CUDA driver API through ctypes: a spin kernel of a chosen duration, on a GPU or fakegpu.

Used by the programs of ``benchmarks/gpu_check.py``; needs no Python package.
On a real GPU the kernels come from PTX (JIT-compiled by the driver): ``krex_noop``
(empty), ``krex_spin_ns(u64 ns)`` and ``krex_stamp(u64 *out, u64 ns)``, which busy-wait
on the GPU's global timer (``%globaltimer``; no calibration) and, for the stamp, write
its start and end times to device memory.  On fakegpu the fake driver's conventions are
used: ``spin_ns_N`` kernels, any module data; stamps come from the fake device's
execution log (its own clock).
"""

from __future__ import annotations

import ctypes
import os

from krex.eval.kernels import DEVICE_PTX

# krex_spin_ns / krex_stamp (krex.eval.kernels: on the GPU's global timer) and an empty kernel.
PTX = DEVICE_PTX + b"""
.visible .entry krex_noop()
{
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
        fn = self.function("krex_spin_ns")
        ns = ctypes.c_uint64(int(ms * 1e6))
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(ns), ctypes.c_void_p))
        self._keep.append((ns, params))
        return lambda: self.launch(fn, params)

    def stamper(self, ms: float, slots: int) -> Stamper:
        """Kernels of about ``ms`` that record their device-clock start and end."""
        return Stamper(self, ms, slots)

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

class Stamper:
    """Launches ``krex_stamp`` kernels, each writing [start, end] of the device's global
    timer (ns) into its own slot of a device buffer; :meth:`stamps` reads them back.  On
    fakegpu the same intervals come from the fake device's execution log."""

    def __init__(self, drv: Driver, ms: float, slots: int) -> None:
        self.drv, self.ms, self.slots, self.n = drv, ms, slots, 0
        self.ns = ctypes.c_uint64(int(ms * 1e6))
        if drv.fake:
            self.fn = drv.function(f"spin_ns_{max(1, int(ms * 1e6))}")
            return
        self.fn = drv.function("krex_stamp")
        self.buf = ctypes.c_uint64()
        drv.check("cuMemAlloc", drv.lib.cuMemAlloc_v2(ctypes.byref(self.buf),
                                                     ctypes.c_size_t(16 * slots)))
        drv.check("cuMemsetD8", drv.lib.cuMemsetD8_v2(self.buf, ctypes.c_ubyte(0),
                                                      ctypes.c_size_t(16 * slots)))
        self._ptrs = [ctypes.c_uint64(0), self.ns]
        self.params = (ctypes.c_void_p * 2)(
            *[ctypes.cast(ctypes.pointer(p), ctypes.c_void_p) for p in self._ptrs])

    def launch(self) -> int:
        """One stamp kernel on the default stream; returns its index."""
        i = self.n
        self.n += 1
        if self.drv.fake:
            self.drv.launch(self.fn)
        else:
            self._ptrs[0].value = self.buf.value + 16 * (i % self.slots)
            self.drv.launch(self.fn, self.params)  # parameters are copied at launch
        return i

    def stamps(self) -> list[tuple[int, int]]:
        """[start, end] ns of every kernel launched so far, in launch order (after a sync)."""
        self.drv.synchronize()
        if self.drv.fake:
            from krex.devices.fakegpu import FakeGpu

            log = FakeGpu(os.environ["KREX_FAKEGPU_SOCKET"]).launch_log()
            mine = [(row[5], row[6]) for row in log if row[1] == os.getpid() and row[3] == 0]
            return mine[-self.n:] if self.n else []
        host = (ctypes.c_uint64 * (2 * self.slots))()
        self.drv.check("cuMemcpyDtoH", self.drv.lib.cuMemcpyDtoH_v2(
            host, self.buf, ctypes.c_size_t(16 * self.slots)))
        count = min(self.n, self.slots)
        first = self.n - count
        return [(host[2 * (i % self.slots)], host[2 * (i % self.slots) + 1])
                for i in range(first, self.n)]
