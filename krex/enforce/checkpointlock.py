"""The NVIDIA driver's own gate: ``cuCheckpointProcessLock`` (driver ≥ 570).

An alternative to the interposer's gate and drain, behind the same
:class:`~krex.enforce.operation.Operation` interface.  NVIDIA documents that
the lock *blocks further CUDA API calls* of the process (it must be RUNNING;
on a timeout it is left RUNNING); it does not promise that work the process
already submitted has finished.  So, per region:

1. siblings whose checkpoint state says they have no CUDA context
   (``cuCheckpointProcessGetState`` fails) are skipped: they have no device
   work (the freeze stops them from creating a context meanwhile);
2. the others are locked **in parallel** (one thread each; ctypes releases
   the GIL); ``CUDA_ERROR_NOT_READY`` and ``CUDA_ERROR_TIMEOUT`` are timeouts
   and abort the region like a drain timeout (every lock taken is undone);
3. then the daemon **waits for their device work to finish** through a
   :class:`DeviceIdle` waiter (fakegpu: the server's queues; NVIDIA: NVML
   utilisation samples newer than the lock).  When it cannot confirm it, the
   region is marked not clean with the reason (:meth:`CheckpointLock.findings`).

Selected with ``krex serve --gpu-lock checkpoint``; off by default until
measured on a GPU.  fakegpu's driver models the documented behaviour.
"""

from __future__ import annotations

import ctypes
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from krex.errors import DrainTimeout

MIN_DRIVER_VERSION = 12080  # CUDA 12.8, the driver API of R570
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_TIMEOUT = 909
LOCK_TIMEOUTS = (CUDA_ERROR_NOT_READY, CUDA_ERROR_TIMEOUT)  # documented / observed codes


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class DeviceIdle(Protocol):
    """Waits until the device work of some processes has finished."""

    def wait(self, pids: list[int], since_wall_s: float, timeout_s: float) -> tuple[bool, str]:
        """(True, "") once idle, else (False, why) by ``timeout_s``."""
        ...


class FakegpuIdle:
    """fakegpu: the server's queues are the device's truth."""

    def __init__(self, gpu: Any) -> None:
        self.gpu = gpu

    def wait(self, pids: list[int], since_wall_s: float, timeout_s: float) -> tuple[bool, str]:
        deadline = time.monotonic() + timeout_s
        while busy := [p for p in pids if self.gpu.queued(p)]:
            if time.monotonic() > deadline:
                return False, f"pids {busy} still had queued device work after {timeout_s} s"
            time.sleep(0.0005)
        return True, ""


class NvmlIdle:
    """NVIDIA: a GPU utilisation sample taken wholly after the lock that reads 0 %.

    NVML samples utilisation over 1/6 s to 1 s, so this costs up to a sample
    period per region; anything still running on the device (a locked
    sibling's queued kernels, or a process krex does not manage) keeps it busy.
    """

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle

    @classmethod
    def for_device(cls, device: str) -> NvmlIdle | None:
        kind, _, index = device.partition(":")
        if kind != "cuda":
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            return cls(pynvml, pynvml.nvmlDeviceGetHandleByIndex(int(index or 0)))
        except Exception:  # no NVML here: nothing can confirm idleness  # noqa: BLE001
            return None

    def wait(self, pids: list[int], since_wall_s: float, timeout_s: float) -> tuple[bool, str]:
        n = self.nvml
        since_us = int(since_wall_s * 1e6)
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                _, samples = n.nvmlDeviceGetSamples(self.handle, n.NVML_GPU_UTILIZATION_SAMPLES,
                                                    since_us)
            except n.NVMLError as exc:
                if "NOT_FOUND" not in type(exc).__name__ and "Not Found" not in str(exc):
                    return False, f"NVML utilisation samples: {exc}"
                samples = []  # none newer yet
            newer = [s for s in samples if s.timeStamp > since_us]
            if len(newer) >= 2:  # the first may straddle the lock
                last = newer[-1].sampleValue.uiVal
                if last == 0:
                    return True, ""
            time.sleep(0.02)
        return False, (f"the GPU was still busy ({last} % in NVML's last sample) "
                       f"{timeout_s} s after locking pids {pids}")


def load_driver(path: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


@dataclass
class CheckpointLock:
    """Lock ``pids`` through the driver (in parallel), unlock them when the region ends."""

    lib: ctypes.CDLL | None
    lib_path: str
    pids: list[int]
    timeout_s: float = 5.0
    name: str = "checkpoint_lock"
    backend: str = "cuCheckpointProcessLock"
    env: dict[str, str] = field(default_factory=dict)  # for the guardian (fakegpu's socket)
    idle: DeviceIdle | None = None
    locked: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # no CUDA context: no device work
    not_locked: list[dict] = field(default_factory=list)
    acks_s: dict[int, float] = field(default_factory=dict)
    _findings: list[dict[str, str]] = field(default_factory=list)

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

    def _has_context(self, pid: int) -> bool:
        state = ctypes.c_int()
        get_state = getattr(self.lib, "cuCheckpointProcessGetState", None)
        return get_state is None or get_state(ctypes.c_int(pid), ctypes.byref(state)) == 0

    def _lock(self, pid: int) -> tuple[int, int, float]:
        assert self.lib is not None  # available() said so
        args = _LockArgs(timeoutMs=max(1, int(self.timeout_s * 1000)))
        t0 = time.perf_counter()
        rc = self.lib.cuCheckpointProcessLock(ctypes.c_int(pid), ctypes.byref(args))
        return pid, int(rc), time.perf_counter() - t0

    def apply(self) -> None:
        targets = [p for p in self.pids if self._has_context(p)]
        self.skipped = [p for p in self.pids if p not in targets]
        since = time.time()
        results = []
        if targets:
            with ThreadPoolExecutor(max_workers=len(targets)) as pool:
                results = list(pool.map(self._lock, targets))
        timeouts = []
        for pid, rc, seconds in results:
            if rc == 0:
                self.locked.append(pid)
                self.acks_s[pid] = seconds
            elif rc in LOCK_TIMEOUTS:
                timeouts.append(pid)
            else:  # e.g. a process that is not RUNNING
                self.not_locked.append({"what": "checkpoint_lock",
                                        "why": f"pid {pid}: cuCheckpointProcessLock error {rc}"})
        if timeouts:
            raise DrainTimeout(f"pid {timeouts[0]} could not be locked within {self.timeout_s} s "
                               "(cuCheckpointProcessLock)", pid=timeouts[0],
                               seconds=self.timeout_s)
        self._wait_idle(since)

    def _wait_idle(self, since_wall_s: float) -> None:
        """NVIDIA does not promise the lock waits for submitted work: confirm it."""
        if not self.locked:
            return
        if self.idle is None:
            ok, why = False, "no way to observe the device here (no NVML)"
        else:
            ok, why = self.idle.wait(list(self.locked), since_wall_s, self.timeout_s)
        if not ok:
            self._findings.append({"what": "checkpoint_lock", "why": (
                "cannot confirm the locked siblings' submitted GPU work finished "
                f"(the lock only blocks further calls): {why}")})

    def findings(self) -> list[dict[str, str]]:
        return list(self._findings)

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
