"""What the candidate's process did besides the call: device launches, other threads' CPU.

Three readings, each from one accessor (so a change of the interposer's or
the kernel's interface is a one-place change):

- :func:`device_launches` — launches this process made through the krex
  interposer (every hooked launch, copy and memset), from the interposer's
  own per-process named counters (``krex.devices.native.COUNTERS``); ``None`` when the
  interposer is not loaded (the ``cpu`` device, or no daemon).
- :class:`ThreadCpu` — CPU time of the threads that did *not* exist when
  the baseline was taken (``/proc/self/task/*/schedstat``, nanoseconds):
  the threads a candidate started.  Library pools that existed before the
  candidate was imported (OpenBLAS spins ~0.1 s after every call) are left
  out on purpose.
- :func:`self_drain_ms` — how long the interposer's drain thread takes to
  acknowledge a close of this process's own gate: it synchronises every
  context the process launched on, so work still queued on a side stream or
  a second context shows as a long drain.  Only called while this process
  holds a region on the device (the daemon never touches the holder's gate).
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

LAUNCH_COUNTERS = ("launch_direct", "launch_dlsym", "launch_getproc")  # by resolution path


class _Interposer:
    """What was found in this process, looked up once (an instance, not class attributes:
    a worker's canary treats a changed class attribute of krex as tampering)."""

    def __init__(self) -> None:
        self.lib: Any = None
        self.launch_indices: tuple[int, ...] = ()
        self.looked = False


_FOUND = _Interposer()


def _interposer() -> Any:
    """The preloaded interposer (its named counters), or None when it is not loaded."""
    if not _FOUND.looked:
        _FOUND.looked = True
        from krex.devices.native import counter_names

        try:
            lib = ctypes.CDLL(None)
            names = counter_names(lib)  # AttributeError: no interposer in this process
        except (AttributeError, OSError):
            return None
        _FOUND.lib = lib
        _FOUND.launch_indices = tuple(names.index(n) for n in LAUNCH_COUNTERS)
    return _FOUND.lib


def device_launches() -> int | None:
    """Launches this process made through the interposer so far (None: not interposed)."""
    lib = _interposer()
    if lib is None:
        return None
    return sum(int(lib.krex_interposer_counter(i)) for i in _FOUND.launch_indices)


def thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _thread_cpu_ns(tid: int) -> int:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class ThreadCpu:
    """CPU nanoseconds of the threads started after the baseline (the candidate's threads).

    A thread's last reading is kept after it exits, so the total never goes
    down; ``most_alive`` is the most such threads seen alive at one reading.
    """

    def __init__(self) -> None:
        self.base: set[int] = thread_ids()
        self.available = os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat")
        self.last: dict[int, int] = {}
        self.most_alive = 0

    def new_threads(self) -> list[int]:
        return sorted(thread_ids() - self.base)

    def read_ns(self) -> int:
        if not self.available:
            return 0
        alive = thread_ids() - self.base
        self.most_alive = max(self.most_alive, len(alive))
        for tid in alive:
            self.last[tid] = max(self.last.get(tid, 0), _thread_cpu_ns(tid))
        return sum(self.last.values())


DRAIN_TIMEOUT_S = 1.0


def self_drain_ms(timeout_s: float = DRAIN_TIMEOUT_S) -> float | None:
    """Close this process's own gate, wait for its drain ack, reopen; milliseconds taken.

    None when the process has no gate file or never launched through the
    interposer (nothing to drain).  A drain that does not finish within
    ``timeout_s`` reads as ``timeout_s`` (the queued work is still there).
    """
    from krex.errors import DrainTimeout

    path = os.environ.get("KREX_GATE_FILE")
    if not path or device_launches() in (None, 0):
        return None
    from krex.enforce.gate import GateFile

    slot = int(os.environ.get("KREX_GATE_SLOT", "0"))
    gate = GateFile.open_existing(path)
    try:
        if os.getpid() not in gate.pids(slot):
            return None
        t0 = time.perf_counter()
        generation = gate.close(slot)
        try:
            gate.wait_drained(slot, generation, timeout_s)
        except DrainTimeout:
            return timeout_s * 1e3
        finally:
            gate.open(slot)
        return (time.perf_counter() - t0) * 1e3
    finally:
        gate.release()
