"""The NVIDIA driver's own gate: ``cuCheckpointProcessLock`` (driver ≥ 570).

An alternative to the interposer's gate and drain, behind the same
:class:`~krex.enforce.operation.Operation` interface: the daemon locks each
sibling process through the driver, which blocks that process's further
CUDA calls and returns once its submitted work has completed; unlocking
lets it go on.  It needs no ``LD_PRELOAD`` but a recent driver, and it locks
whole processes (every CUDA call, not only launches).  Selected with
``krex serve --gpu-lock checkpoint``; off by default until measured on a GPU.
fakegpu's driver implements the same two calls, so the path is tested here.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from krex.errors import DrainTimeout

MIN_DRIVER_VERSION = 12080  # CUDA 12.8, the driver API of R570


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


def load_driver(path: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


@dataclass
class CheckpointLock:
    """Lock ``pids`` through the driver (in order), unlock them in reverse."""

    lib: ctypes.CDLL | None
    lib_path: str
    pids: list[int]
    timeout_s: float = 5.0
    name: str = "checkpoint_lock"
    backend: str = "cuCheckpointProcessLock"
    env: dict[str, str] = field(default_factory=dict)  # for the guardian (fakegpu's socket)
    locked: list[int] = field(default_factory=list)
    not_locked: list[dict] = field(default_factory=list)
    acks_s: dict[int, float] = field(default_factory=dict)

    def available(self) -> tuple[bool, str]:
        lib = self.lib
        if lib is None:
            return False, f"cannot load the CUDA driver {self.lib_path}"
        if not hasattr(lib, "cuCheckpointProcessLock"):
            return False, "the driver has no cuCheckpointProcessLock (needs R570 or newer)"
        version = ctypes.c_int()
        lib.cuInit(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or \
                version.value < MIN_DRIVER_VERSION:
            return False, f"driver API {version.value} < {MIN_DRIVER_VERSION}"
        return True, ""

    def apply(self) -> None:
        import time

        assert self.lib is not None  # available() said so
        args = _LockArgs(timeoutMs=max(1, int(self.timeout_s * 1000)))
        for pid in self.pids:
            t0 = time.perf_counter()
            rc = self.lib.cuCheckpointProcessLock(ctypes.c_int(pid), ctypes.byref(args))
            if rc == 909:  # CUDA_ERROR_TIMEOUT
                raise DrainTimeout(f"pid {pid} did not finish its queued GPU work within "
                                   f"{self.timeout_s} s (cuCheckpointProcessLock)",
                                   pid=pid, seconds=self.timeout_s)
            if rc != 0:  # e.g. a process that never created a CUDA context
                self.not_locked.append({"what": "checkpoint_lock",
                                        "why": f"pid {pid}: cuCheckpointProcessLock error {rc}"})
                continue
            self.locked.append(pid)
            self.acks_s[pid] = time.perf_counter() - t0

    def revert(self) -> None:
        errors = []
        while self.locked:
            pid = self.locked.pop()
            assert self.lib is not None  # it locked pid
            rc = self.lib.cuCheckpointProcessUnlock(ctypes.c_int(pid), None)
            if rc != 0:
                errors.append(f"{pid}: error {rc}")
        if errors:
            raise RuntimeError("cuCheckpointProcessUnlock failed for " + ", ".join(errors))

    def undo_records(self) -> list[dict]:
        return [{"kind": "cuda_unlock", "lib": self.lib_path, "pid": pid, "env": self.env}
                for pid in self.pids]
