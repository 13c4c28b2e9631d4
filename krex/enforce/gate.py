"""The gate file: the daemon's side of the gate and drain (docs/native.md).

One file per job, named to the job's processes in ``KREX_GATE_FILE``; the
native interposer (native/interpose/gate.h, the authoritative layout) maps it
in every process of the job.  The daemon closes a job's gate on a device
slot, waits until every process of the job has acknowledged the drain of its
queued GPU work, and opens the gate again when the region ends.

    gate = GateFile.create(path, ndev=1)
    gen = gate.close(0)
    acks = gate.wait_drained(0, gen, timeout_s=5.0)   # {pid: ack latency s}
    ...
    gate.open(0)
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from krex.devices.native import ABI_VERSION, COUNTERS
from krex.enforce.process import ProcessRef, task_stat
from krex.errors import DrainTimeout, EnforcementFailed

MAGIC = 0x4758524B  # "KRXG"
NSLOTS = 64  # KREX_GATE_NSLOTS
MAX_DEV = 64
SLOT_COUNTERS = 16  # KREX_SLOT_COUNTERS
# ack_status values that are not a driver error code (KREX_DRAIN_* in gate.h).
DRAIN_REASONS = {
    -1: "the driver's synchronisation calls were not found: its queued work was not waited for",
    -2: "default-stream work was not synchronised: a stream capture was in progress",
}


class _Header(ctypes.Structure):
    _fields_ = [
        ("magic", ctypes.c_uint32),
        ("abi_version", ctypes.c_uint32),
        ("ndev", ctypes.c_uint32),
        ("nslots", ctypes.c_uint32),
        ("pad", ctypes.c_uint8 * 48),
    ]


class _Proc(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint32),
        ("in_flight", ctypes.c_uint32),
        ("ack_generation", ctypes.c_uint64),
        ("ack_ns", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("parked", ctypes.c_uint64),
        ("start_time", ctypes.c_uint64),
        ("ack_status", ctypes.c_int32),
        ("pad0", ctypes.c_uint32),
        ("pad1", ctypes.c_uint8 * 8),
        ("counters", ctypes.c_uint64 * SLOT_COUNTERS),
    ]


class _Dev(ctypes.Structure):
    _fields_ = [
        ("gate", ctypes.c_uint32),
        ("overflow_procs", ctypes.c_uint32),
        ("generation", ctypes.c_uint64),
        ("pad1", ctypes.c_uint64),
        ("close_ns", ctypes.c_uint64),
        ("pad", ctypes.c_uint8 * 32),
        ("procs", _Proc * NSLOTS),
    ]


assert ctypes.sizeof(_Header) == 64 and ctypes.sizeof(_Proc) == 192
assert ctypes.sizeof(_Dev) == 64 + 192 * NSLOTS and len(COUNTERS) <= SLOT_COUNTERS


@dataclass(frozen=True)
class Slot:
    """One process slot as the daemon sees it: its owner (pid + start time, so a
    reused pid never passes for it), drain acknowledgement and named counters."""

    pid: int
    start_time: int
    ack_generation: int
    ack_status: int
    counters: dict[str, int]

    @property
    def owner(self) -> ProcessRef:
        return ProcessRef(self.pid, self.start_time)


def _owner(p: _Proc) -> ProcessRef | None:
    """The live process that owns slot ``p``, or None (free, gone, or pid reused)."""
    pid, claimed = int(p.pid), int(p.start_time)
    st = task_stat(pid) if pid else None
    if st is None or st.state in "ZX":
        return None  # free, or its owner is gone (a zombie has no GPU work left)
    now = st.start_time
    if claimed and now != claimed:
        return None  # stale: the pid now names another process; the interposer reclaims it
    return ProcessRef(pid, now)


def drain_reason(status: int) -> str:
    """What a drain acknowledgement's non-zero status means."""
    return DRAIN_REASONS.get(status, f"a stream synchronisation returned error {status}")

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_FUTEX_WAKE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def file_size(ndev: int) -> int:
    """Bytes of a gate file with ``ndev`` device slots."""
    return ctypes.sizeof(_Header) + ndev * ctypes.sizeof(_Dev)


def _futex_wake(word: ctypes.c_uint32) -> None:
    """Wake every waiter on a shared futex word (also a full memory barrier)."""
    if _SYS_FUTEX is None:
        return  # waiters re-check on their own (drain thread ticks every 200 ms)
    _libc.syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(ctypes.addressof(word)),
        ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(0x7FFFFFFF),
        None,
        None,
        ctypes.c_int(0),
    )


class GateFile:
    """A mapped gate file; every method is safe to call from one daemon thread."""

    def __init__(self, path: str | os.PathLike[str], mm: mmap.mmap) -> None:
        self.path = Path(path)
        self._mm = mm
        self._header = _Header.from_buffer(mm, 0)
        self.ndev = int(self._header.ndev)
        self._devs = [
            _Dev.from_buffer(mm, ctypes.sizeof(_Header) + d * ctypes.sizeof(_Dev))
            for d in range(self.ndev)
        ]

    @classmethod
    def create(cls, path: str | os.PathLike[str], ndev: int = 1, mode: int = 0o600) -> GateFile:
        """Create (or reset) a gate file with every gate open."""
        if not 1 <= ndev <= MAX_DEV:
            raise ValueError(f"ndev must be 1..{MAX_DEV}, got {ndev}")
        tmp = Path(f"{path}.tmp{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.ftruncate(fd, file_size(ndev))
            mm = mmap.mmap(fd, file_size(ndev))
        finally:
            os.close(fd)
        header = _Header.from_buffer(mm, 0)
        header.abi_version, header.ndev, header.nslots = ABI_VERSION, ndev, NSLOTS
        header.magic = MAGIC
        del header
        os.replace(tmp, path)  # processes never see a half-written file
        return cls(path, mm)

    @classmethod
    def open_existing(cls, path: str | os.PathLike[str]) -> GateFile:
        """Map an existing gate file (e.g. a daemon restarting and sweeping)."""
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        h = _Header.from_buffer(mm, 0)
        ok = (h.magic, h.abi_version, h.nslots) == (MAGIC, ABI_VERSION, NSLOTS)
        del h
        if not ok:
            mm.close()
            raise EnforcementFailed(f"{path} is not a krex gate file of ABI {ABI_VERSION}")
        return cls(path, mm)

    def _dev(self, slot: int) -> _Dev:
        if not 0 <= slot < self.ndev:
            raise ValueError(f"gate slot {slot} out of range 0..{self.ndev - 1}")
        return self._devs[slot]

    def close(self, slot: int = 0) -> int:
        """Close the gate: new launches park.  Returns the close's generation."""
        dev = self._dev(slot)
        dev.close_ns = time.monotonic_ns()
        dev.generation += 1
        dev.gate = 1
        _futex_wake(self._word(dev, _Dev.generation.offset))  # low word, little-endian
        # (the syscall also orders the stores above before any later read of in_flight)
        return int(dev.generation)

    def open(self, slot: int = 0) -> None:
        """Open the gate and wake every parked launch (a no-op once released:
        :meth:`unlink` opened every gate before it let go of the file)."""
        if self.released:
            return
        dev = self._dev(slot)
        dev.gate = 0
        _futex_wake(self._word(dev, _Dev.gate.offset))

    def open_all(self) -> None:
        """Open every slot (crash recovery, guardian)."""
        for slot in range(self.ndev):
            self.open(slot)

    def _word(self, dev: _Dev, offset: int) -> ctypes.c_uint32:
        """The 32-bit futex word at ``offset`` inside ``dev``."""
        base = ctypes.addressof(dev) - ctypes.addressof(self._header)
        return ctypes.c_uint32.from_buffer(self._mm, base + offset)

    def is_closed(self, slot: int = 0) -> bool:
        return bool(self._dev(slot).gate)

    def generation(self, slot: int = 0) -> int:
        return int(self._dev(slot).generation)

    def _live(self, slot: int) -> list[tuple[_Proc, ProcessRef]]:
        """(slot record, owner) of every slot whose owner is alive and the same process."""
        return [(p, ref) for p in self._dev(slot).procs if (ref := _owner(p)) is not None]

    def pids(self, slot: int = 0) -> list[int]:
        """Live processes that have made gated calls on this slot (claimed a process slot)."""
        return [ref.pid for _, ref in self._live(slot)]

    def slots(self, slot: int = 0) -> list[Slot]:
        """The live, verified process slots of a device record."""
        return [Slot(ref.pid, ref.start_time, int(p.ack_generation), int(p.ack_status),
                     dict(zip(COUNTERS, (int(c) for c in p.counters), strict=False)))
                for p, ref in self._live(slot)]

    def owner(self, slot: int, pid: int) -> ProcessRef | None:
        """The verified owner of ``pid``'s slot (pid + the start time it claimed with)."""
        return next((ref for _, ref in self._live(slot) if ref.pid == pid), None)

    def overflow_procs(self, slot: int = 0) -> int:
        """Processes that found every slot taken (they run ungated)."""
        return int(self._dev(slot).overflow_procs)

    def interposed(self, slot: int | None = None) -> bool:
        """True when at least one live process of the job runs the interposer."""
        slots = range(self.ndev) if slot is None else [slot]
        return any(self.pids(s) for s in slots)

    def in_flight(self, slot: int = 0) -> int:
        """Launches of live processes currently inside the driver."""
        return sum(int(p.in_flight) for p, _ in self._live(slot))

    def launches(self, slot: int = 0) -> dict[int, int]:
        """Launches accepted per live pid (counter kept by the interposer)."""
        return {ref.pid: int(p.launches) for p, ref in self._live(slot)}

    def wait_quiesced(self, slot: int = 0, timeout_s: float = 5.0) -> float:
        """Wait until no launch is inside the driver; returns seconds since the close."""
        dev = self._dev(slot)
        deadline = time.monotonic() + timeout_s
        while self.in_flight(slot):
            if time.monotonic() > deadline:
                raise DrainTimeout(
                    f"launches still in the driver after {timeout_s} s",
                    seconds=timeout_s,
                    device=str(slot),
                )
            time.sleep(0)
        return (time.monotonic_ns() - dev.close_ns) / 1e9

    def _pending(self, slot: int, generation: int) -> list[int]:
        return [ref.pid for p, ref in self._live(slot) if p.ack_generation < generation]

    def pending(self, slot: int, generation: int) -> list[int]:
        """Live processes that have not acknowledged the drain of ``generation`` yet."""
        return self._pending(slot, generation)

    def acks(self, slot: int, generation: int) -> dict[int, float]:
        """``{pid: seconds from close to its ack}`` of the processes that acked."""
        dev = self._dev(slot)
        return {ref.pid: max(0, int(p.ack_ns) - int(dev.close_ns)) / 1e9
                for p, ref in self._live(slot) if p.ack_generation >= generation}

    def wait_drained(self, slot: int, generation: int, timeout_s: float = 10.0) -> dict[int, float]:
        """Wait for every live process's drain ack of ``generation``.

        Returns ``{pid: seconds from close to that process's ack}``; raises
        :class:`~krex.errors.DrainTimeout` naming a process that did not ack.
        """
        dev = self._dev(slot)
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while pending := self._pending(slot, generation):
            if time.monotonic() > deadline:
                raise DrainTimeout(
                    f"pid {pending[0]} did not drain its queued GPU work within {timeout_s} s",
                    pid=pending[0],
                    device=str(slot),
                    seconds=timeout_s,
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return {
            ref.pid: max(0, int(p.ack_ns) - int(dev.close_ns)) / 1e9
            for p, ref in self._live(slot)
            if p.ack_generation >= generation
        }

    @property
    def released(self) -> bool:
        return self._header is None

    def release(self) -> None:
        """Unmap (the gates stay as they are; open them first if needed)."""
        self._devs.clear()
        self._header = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a traceback still holds a view; the mapping goes with it

    def unlink(self) -> None:
        """Open every gate, unmap and remove the file."""
        self.open_all()
        self.release()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> GateFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unlink()
