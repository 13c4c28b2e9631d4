"""The device context a worker creates once and checks after every program.

``open_context(device)`` returns an object with ``info`` (what was created),
``probe()`` (``None`` when healthy, else why not: a sticky device error) and
``memory_mb()`` (device memory in use, RSS on ``cpu``).  CUDA and fakegpu go
through the driver API with ctypes on ``libcuda.so.1`` (the primary context,
which the CUDA runtime and torch share); ROCm through ``libamdhip64.so``.
Nothing here is imported or loaded until a worker asks for it.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20


class DeviceInitError(RuntimeError):
    """The device context could not be created."""


class CpuContext:
    """No context: the interpreter and imports are what is kept warm."""

    def __init__(self, device: str) -> None:
        self.info: dict[str, Any] = {"device": device, "backend": "cpu"}

    def probe(self) -> str | None:
        return None

    def memory_mb(self) -> float | None:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_MB


class CudaDriverContext:
    """The device's primary context, retained once through the driver API."""

    def __init__(self, device: str, ordinal: int) -> None:
        self.lib, path = _load_libcuda(device)
        self.ctx = ctypes.c_void_p()
        self._check("cuInit", self.lib.cuInit(0))
        dev = ctypes.c_int()
        self._check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), ordinal))
        retain = self.lib.cuDevicePrimaryCtxRetain
        self._check("cuDevicePrimaryCtxRetain", retain(ctypes.byref(self.ctx), dev))
        self._check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self.ctx))
        self.info = {"device": device, "backend": "cuda-driver", "library": path,
                     "ordinal": ordinal}

    def probe(self) -> str | None:
        for name, rc in (("cuCtxSetCurrent", lambda: self.lib.cuCtxSetCurrent(self.ctx)),
                         ("cuCtxSynchronize", self.lib.cuCtxSynchronize)):
            code = rc()
            if code != 0:
                return f"{name} failed: {self._error_name(code)}"
        return None

    def memory_mb(self) -> float | None:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        fn = getattr(self.lib, "cuMemGetInfo_v2", None) or getattr(self.lib, "cuMemGetInfo", None)
        if fn is None or fn(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        return (total.value - free.value) / 2**20

    def _check(self, name: str, code: int) -> None:
        if code != 0:
            raise DeviceInitError(f"{name} failed: {self._error_name(code)}")

    def _error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        try:
            if self.lib.cuGetErrorName(code, ctypes.byref(text)) == 0 and text.value:
                return f"{text.value.decode()} ({code})"
        except AttributeError:
            pass
        return f"CUresult {code}"


class HipContext:
    """A HIP context on one device, forced into existence with hipFree(0)."""

    def __init__(self, device: str, ordinal: int) -> None:
        try:
            self.lib = ctypes.CDLL(os.environ.get("KREX_LIBHIP", "libamdhip64.so"))
        except OSError as e:
            raise DeviceInitError(f"cannot load the HIP runtime: {e}") from e
        for name, code in (("hipInit", lambda: self.lib.hipInit(0)),
                           ("hipSetDevice", lambda: self.lib.hipSetDevice(ordinal)),
                           ("hipFree", lambda: self.lib.hipFree(None))):
            if code() != 0:
                raise DeviceInitError(f"{name} failed")
        self.info = {"device": device, "backend": "hip", "ordinal": ordinal}

    def probe(self) -> str | None:
        code = self.lib.hipDeviceSynchronize()
        return None if code == 0 else f"hipDeviceSynchronize failed: hipError {code}"

    def memory_mb(self) -> float | None:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if self.lib.hipMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        return (total.value - free.value) / 2**20


def open_context(device: str) -> CpuContext | CudaDriverContext | HipContext:
    kind, _, index = device.partition(":")
    ordinal = int(index or 0)
    if kind == "cpu":
        return CpuContext(device)
    if kind in ("cuda", "fakegpu"):
        return CudaDriverContext(device, ordinal)
    if kind == "rocm":
        return HipContext(device, ordinal)
    raise DeviceInitError(f"unknown device kind {kind!r} in {device!r}")


def libcuda_candidates(device: str) -> list[str]:
    """Where to look for the driver: KREX_LIBCUDA, the fake one for fakegpu, the system's."""
    out = [os.environ["KREX_LIBCUDA"]] if os.environ.get("KREX_LIBCUDA") else []
    if device.startswith("fakegpu"):
        out.extend(_fakegpu_libraries())
    out.append("libcuda.so.1")
    return out


def _fakegpu_libraries() -> list[str]:
    out = []
    try:  # the fakegpu module knows best where it built its driver
        from krex.devices import fakegpu

        for name in ("library_path", "libcuda_path"):
            attr = getattr(fakegpu, name, None)
            value = attr() if callable(attr) else attr
            if value:
                out.append(str(value))
    except Exception:  # noqa: BLE001, S110 - an optional module: its paths are extras
        pass
    native = Path(__file__).resolve().parent.parent / "_native" / "fakegpu"
    out.extend(str(p) for p in sorted(native.glob("**/libcuda.so.1")))
    return out


def _load_libcuda(device: str) -> tuple[ctypes.CDLL, str]:
    errors = []
    for path in libcuda_candidates(device):
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise DeviceInitError("cannot load libcuda.so.1 (" + "; ".join(errors) + ")")
