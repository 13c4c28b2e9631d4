"""Device event timers: CUDA, HIP and fakegpu, every import lazy.

- :class:`DriverEventTimer` speaks the CUDA *driver* API through ctypes on
  ``libcuda.so.1`` (``cuEventCreate`` / ``cuEventRecord`` /
  ``cuEventElapsedTime``): it works with the real driver and with fakegpu's
  fake ``libcuda.so.1`` alike, and needs no Python package.
- :class:`HipEventTimer` is the same over ``libamdhip64.so``.
- :class:`TorchEventTimer` uses ``torch.cuda.Event`` (CUDA and ROCm builds).
- :func:`CudaEventTimer` picks torch when it is imported and sees a device,
  else the driver API.

Events are recorded on the default stream; one sample is a start/stop event
pair taken from a pool; ``synchronize()`` waits for the whole batch.  The L2
flush writes a device buffer of ``2 x L2`` bytes (256 MiB when unknown).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
from typing import Any

from krex.errors import DeviceTimerUnavailable, FakegpuServerMissing

CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38
DEFAULT_FLUSH_BYTES = 256 << 20
FAKEGPU_FLUSH_BYTES = 1 << 20  # fakegpu has no cache; exercise the path cheaply


class _EventApi:
    """Symbol table of one event API: CUDA driver or HIP runtime."""

    def __init__(self, lib: ctypes.CDLL, names: dict[str, tuple[str, ...]]) -> None:
        self.lib = lib
        self.fns = {key: _first_symbol(lib, alts) for key, alts in names.items()}

    def has(self, key: str) -> bool:
        return self.fns.get(key) is not None

    def call(self, key: str, *args: Any) -> None:
        fn = self.fns.get(key)
        if fn is None:
            raise DeviceTimerUnavailable(f"{key} is missing from {self.lib._name}")
        result = fn(*args)
        if result != 0:
            raise DeviceTimerUnavailable(f"{key} failed with error {result}")


def _first_symbol(lib: ctypes.CDLL, names: tuple[str, ...]) -> Any:
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return fn
    return None


CUDA_NAMES: dict[str, tuple[str, ...]] = {
    "init": ("cuInit",),
    "device_get": ("cuDeviceGet",),
    "ctx_retain": ("cuDevicePrimaryCtxRetain",),
    "ctx_get": ("cuCtxGetCurrent",),
    "ctx_set": ("cuCtxSetCurrent",),
    "event_create": ("cuEventCreate",),
    "event_record": ("cuEventRecord",),
    "event_sync": ("cuEventSynchronize",),
    "elapsed": ("cuEventElapsedTime_v2", "cuEventElapsedTime"),
    "attribute": ("cuDeviceGetAttribute",),
    "malloc": ("cuMemAlloc_v2",),
    "memset_async": ("cuMemsetD8Async",),
    "synchronize": ("cuCtxSynchronize",),
}

HIP_NAMES: dict[str, tuple[str, ...]] = {
    "init": ("hipInit",),
    "set_device": ("hipSetDevice",),
    "event_create": ("hipEventCreate",),
    "event_record": ("hipEventRecord",),
    "event_sync": ("hipEventSynchronize",),
    "elapsed": ("hipEventElapsedTime",),
    "malloc": ("hipMalloc",),
    "memset_async": ("hipMemsetAsync",),
    "synchronize": ("hipDeviceSynchronize",),
}


class _NativeEventTimer:
    """Shared event-pair logic over an :class:`_EventApi`."""

    name = "native-events"
    resolution_ms = 0.0005  # CUDA/HIP events resolve about 0.5 us

    def __init__(self, api: _EventApi, device: str) -> None:
        self.api = api
        self.device = device
        self._pool: list[ctypes.c_void_p] = []
        self._flush_ptr: ctypes.c_void_p | None = None
        self._flush_bytes = DEFAULT_FLUSH_BYTES

    def _event(self) -> ctypes.c_void_p:
        if self._pool:
            return self._pool.pop()
        ev = ctypes.c_void_p()
        self.api.call("event_create", ctypes.byref(ev), ctypes.c_uint(0))
        return ev

    def _record(self) -> ctypes.c_void_p:
        ev = self._event()
        self.api.call("event_record", ev, ctypes.c_void_p(0))
        return ev

    def start(self) -> ctypes.c_void_p:
        return self._record()

    def stop(self, start: ctypes.c_void_p) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        return start, self._record()

    def synchronize(self) -> None:
        self.api.call("synchronize")

    def elapsed_ms(self, pending: tuple[ctypes.c_void_p, ctypes.c_void_p]) -> float:
        start, end = pending
        self.api.call("event_sync", end)
        ms = ctypes.c_float()
        self.api.call("elapsed", ctypes.byref(ms), start, end)
        self._pool.extend((start, end))
        return float(ms.value)

    def now_s(self) -> float:
        import time

        return time.perf_counter()

    @property
    def flush_bytes(self) -> int:
        """Bytes written per cold-cache flush (0 when the API cannot flush)."""
        return self._flush_bytes if self.api.has("malloc") and self.api.has("memset_async") else 0

    def flush_cache(self) -> None:
        """memset a 2 x L2 device buffer on the stream; skipped if the API lacks it."""
        if not (self.api.has("malloc") and self.api.has("memset_async")):
            return
        if self._flush_ptr is None:
            ptr = ctypes.c_void_p()
            self.api.call("malloc", ctypes.byref(ptr), ctypes.c_size_t(self._flush_bytes))
            self._flush_ptr = ptr
        self.api.call(
            "memset_async",
            self._flush_ptr,
            ctypes.c_ubyte(0),
            ctypes.c_size_t(self._flush_bytes),
            ctypes.c_void_p(0),
        )


class DriverEventTimer(_NativeEventTimer):
    """CUDA driver-API events through ctypes (real driver or fakegpu)."""

    name = "cuda-driver-events"

    def __init__(self, index: int = 0, lib_path: str = "libcuda.so.1", device: str = "") -> None:
        try:
            lib = ctypes.CDLL(lib_path)
        except OSError as exc:
            raise DeviceTimerUnavailable(f"cannot load {lib_path}: {exc}") from exc
        super().__init__(_EventApi(lib, CUDA_NAMES), device or f"cuda:{index}")
        self.api.call("init", ctypes.c_uint(0))
        dev = ctypes.c_int()
        self.api.call("device_get", ctypes.byref(dev), ctypes.c_int(index))
        self._bind_context(dev)
        self._flush_bytes = 2 * self._l2_bytes(dev) or DEFAULT_FLUSH_BYTES

    def _bind_context(self, dev: ctypes.c_int) -> None:
        current = ctypes.c_void_p()
        if self.api.has("ctx_get"):
            self.api.call("ctx_get", ctypes.byref(current))
        if current.value:
            return
        ctx = ctypes.c_void_p()
        self.api.call("ctx_retain", ctypes.byref(ctx), dev)
        self.api.call("ctx_set", ctx)

    def _l2_bytes(self, dev: ctypes.c_int) -> int:
        if not self.api.has("attribute"):
            return 0
        value = ctypes.c_int()
        try:
            self.api.call("attribute", ctypes.byref(value), CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev)
        except DeviceTimerUnavailable:
            return 0
        return max(0, value.value)


class HipEventTimer(_NativeEventTimer):
    """HIP runtime events through ctypes on ``libamdhip64.so`` (thin; untested here)."""

    name = "hip-events"

    def __init__(self, index: int = 0, lib_path: str = "libamdhip64.so") -> None:
        try:
            lib = ctypes.CDLL(lib_path)
        except OSError as exc:
            raise DeviceTimerUnavailable(f"cannot load {lib_path}: {exc}") from exc
        super().__init__(_EventApi(lib, HIP_NAMES), f"rocm:{index}")
        self.api.call("init", ctypes.c_uint(0))
        self.api.call("set_device", ctypes.c_int(index))


class TorchEventTimer:
    """``torch.cuda.Event`` pairs on the current stream (CUDA or ROCm torch)."""

    name = "torch-events"
    resolution_ms = 0.0005

    def __init__(self, index: int = 0, device: str = "") -> None:
        import torch

        self._torch = torch
        self.device = device or f"cuda:{index}"
        self._index = index
        self._flush_buffer: Any = None

    def start(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, start: Any) -> tuple[Any, Any]:
        end = self._torch.cuda.Event(enable_timing=True)
        end.record()
        return start, end

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def elapsed_ms(self, pending: tuple[Any, Any]) -> float:
        start, end = pending
        end.synchronize()
        return float(start.elapsed_time(end))

    def now_s(self) -> float:
        import time

        return time.perf_counter()

    def flush_cache(self) -> None:
        if self._flush_buffer is None:
            props = self._torch.cuda.get_device_properties(self._index)
            size = 2 * int(getattr(props, "L2_cache_size", 0)) or DEFAULT_FLUSH_BYTES
            self._flush_buffer = self._torch.empty(
                size, dtype=self._torch.int8, device=f"cuda:{self._index}"
            )
        self._flush_buffer.zero_()


def _torch_sees_gpu() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            torch = importlib.import_module("torch")  # only when installed
        except ImportError:
            return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA setup must not break the CPU path
        return False


def CudaEventTimer(index: int = 0) -> Any:  # noqa: N802  (a factory named as the timer)
    """torch.cuda events when torch sees a GPU, else driver-API events."""
    if _torch_sees_gpu():
        return TorchEventTimer(index)
    return DriverEventTimer(index)


def fakegpu_library() -> str | None:
    """fakegpu's ``libcuda.so.1``: $KREX_FAKEGPU_LIB, else the one krex built."""
    env = os.environ.get("KREX_FAKEGPU_LIB")
    if env:
        return env
    try:
        from krex.devices.native import fakegpu_lib_dir
    except ImportError:
        return None
    path = fakegpu_lib_dir() / "libcuda.so.1"
    return str(path) if path.exists() else None


def fakegpu_server_problem(env: dict[str, str] | None = None) -> str | None:
    """Why fakegpu's driver cannot reach a device server, or None when one answers."""
    import socket

    path = (os.environ if env is None else env).get("KREX_FAKEGPU_SOCKET")
    if not path:
        return "no fakegpu device server: KREX_FAKEGPU_SOCKET is not set in this process"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
        except OSError as exc:
            return f"no fakegpu device server answers at {path} ({exc.strerror or exc})"
    return None


class FakegpuTimer(DriverEventTimer):
    """Driver-API events against fakegpu's fake ``libcuda.so.1``."""

    name = "fakegpu-events"

    def __init__(self, index: int = 0, lib_path: str | None = None) -> None:
        path = lib_path or fakegpu_library()
        if not path:
            raise DeviceTimerUnavailable("fakegpu's libcuda.so.1 was not found", device="fakegpu")
        problem = fakegpu_server_problem()
        if problem:
            raise FakegpuServerMissing(problem, device=f"fakegpu:{index}")
        super().__init__(index, lib_path=path, device=f"fakegpu:{index}")
        if self._flush_bytes == DEFAULT_FLUSH_BYTES:  # fakegpu reports no L2: flush a token
            self._flush_bytes = FAKEGPU_FLUSH_BYTES
