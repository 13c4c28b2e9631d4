"""PID-reuse-safe process handles and the /proc readers (krex's one stat parser).

A :class:`ProcessRef` is a PID plus the process start time (field 22 of
``/proc/PID/stat``, in clock ticks) — krex's one type for "a process": the
daemon's jobs and peers, enforcement targets and undo records all use it.
Every signal krex sends goes through
:meth:`ProcessRef.send_signal`, which re-checks the start time (through a
pidfd where the kernel has one, so the check and the signal address the same
process) and refuses PID <= 1, this process and every PID in ``PROTECTED``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from krex.errors import ProcessGone

# PIDs enforcement must never signal, freeze or move: the daemon adds itself
# and its guardian.
PROTECTED: set[int] = set()

_HAVE_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


def read_bytes(path: str) -> bytes:
    """A whole /proc or cgroup file by ``os.read``: no file object, no buffer (half the
    cost of ``open().read()``; these are read on a region's grant path)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


@dataclass(frozen=True, slots=True)
class TaskStat:
    """The fields krex reads of ``/proc/PID/stat`` (or a thread's ``task/TID/stat``),
    named (proc(5): field numbers in the comments)."""

    comm: str  # (2)
    state: str  # (3) R, S, D, T, t, Z, X...
    ppid: int  # (4)
    pgrp: int  # (5)
    flags: int  # (9) PF_* (PF_KTHREAD: a kernel thread)
    nice: int  # (19)
    start_time: int  # (22) clock ticks after boot
    processor: int  # (39) the CPU it last ran on

    @classmethod
    def parse(cls, data: bytes) -> TaskStat | None:
        """From a stat file's bytes; None when it is cut short."""
        head, _, tail = data.rpartition(b")")
        f = tail.split()
        if len(f) < 37:
            return None
        return cls(comm=head.partition(b"(")[2].decode(errors="replace"),
                   state=f[0].decode(), ppid=int(f[1]), pgrp=int(f[2]), flags=int(f[6]),
                   nice=int(f[16]), start_time=int(f[19]), processor=int(f[36]))


def task_stat(pid: int, tid: int | None = None) -> TaskStat | None:
    """``/proc/PID/stat`` (or thread ``tid``'s), parsed; None when it is gone.  Other
    errors (out of descriptors, say) raise: they do not say the task is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        return TaskStat.parse(read_bytes(path))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def start_time(pid: int, tid: int | None = None) -> int | None:
    st = task_stat(pid, tid)
    return st.start_time if st else None


def parent_pid(pid: int) -> int | None:
    st = task_stat(pid)
    return st.ppid if st else None


def process_uid(pid: int) -> int | None:
    """The user a process runs as (the owner of ``/proc/PID``: its effective uid, root for
    a set-user-ID program that is not dumpable); None once it is gone."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def process_group(pid: int) -> int | None:
    st = task_stat(pid)
    return st.pgrp if st else None


def is_descendant(pid: int, ancestor: int) -> bool:
    """True when ``pid`` is ``ancestor`` or below it in the process tree."""
    seen = 0
    while pid and pid > 1 and seen < 4096:
        if pid == ancestor:
            return True
        nxt = parent_pid(pid)
        if nxt is None:
            return False
        pid = nxt
        seen += 1
    return pid == ancestor


def state(pid: int, tid: int | None = None) -> str | None:
    """Single-letter scheduler state (R, S, D, T, t, Z, X...), None if gone."""
    st = task_stat(pid, tid)
    return st.state if st else None


def thread_ids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []


def may_touch(pid: int) -> bool:
    """The safety rule: never PID <= 1, this process, or a protected PID."""
    return pid > 1 and pid != os.getpid() and pid not in PROTECTED


@dataclass(frozen=True)
class ProcessRef:
    """A process, named by PID and start time so a reused PID never matches."""

    pid: int
    start_time: int

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        started = start_time(pid)
        if started is None:
            raise ProcessGone(f"process {pid} does not exist", pid=pid)
        return cls(pid, started)

    def alive(self) -> bool:
        st = task_stat(self.pid)
        return st is not None and st.start_time == self.start_time and st.state not in "ZX"

    def state(self) -> str | None:
        """Scheduler state if this is still the same process, else None."""
        st = task_stat(self.pid)
        if st is None or st.start_time != self.start_time:
            return None
        return st.state

    def send_signal(self, sig: int) -> bool:
        """Signal this exact process; False if it is gone, reused or protected."""
        if not may_touch(self.pid):
            return False
        if _HAVE_PIDFD:
            return self._pidfd_signal(sig)
        if start_time(self.pid) != self.start_time:
            return False
        return _kill(self.pid, sig)

    def _pidfd_signal(self, sig: int) -> bool:
        try:
            fd = os.pidfd_open(self.pid)
        except (ProcessLookupError, OSError):
            return False
        try:
            # The pidfd pins the process: if the start time matches now, the
            # signal below reaches this process and no other.
            if start_time(self.pid) != self.start_time:
                return False
            signal.pidfd_send_signal(fd, sig)
            return True
        except ProcessLookupError:
            return False
        finally:
            os.close(fd)


def _kill(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


@dataclass(frozen=True)
class ThreadRef:
    """One thread (TID plus start time) of a process, for per-thread affinity."""

    pid: int
    tid: int
    start_time: int

    def alive(self) -> bool:
        return start_time(self.pid, self.tid) == self.start_time


def threads_of(ref: ProcessRef) -> list[ThreadRef]:
    out = []
    for tid in thread_ids(ref.pid):
        started = start_time(ref.pid, tid)
        if started is not None:
            out.append(ThreadRef(ref.pid, tid, started))
    return out


@dataclass(frozen=True)
class ProcessGroup:
    """A job's process group, named by its leader (whose pid is the group's number) and
    the leader's start time.  Its members are the job's only while that leader lives: a
    group whose members are all gone leaves its number free, and the kernel gives it to
    the next process that asks, a stranger's (issue 44)."""

    leader: ProcessRef

    @property
    def pgid(self) -> int:
        return self.leader.pid

    @classmethod
    def of(cls, pid: int) -> ProcessGroup | None:
        """``pid``'s group while its leader lives; None without one (a group whose leader
        is gone is not matched: nothing tells its members from a later stranger's)."""
        number = process_group(pid)
        if number is None or number <= 1:
            return None
        try:
            return cls(ProcessRef.of(number))
        except ProcessGone:
            return None

    @classmethod
    def led_by(cls, pid: int) -> ProcessGroup:
        """The group numbered ``pid``, led by that process (raises ProcessGone)."""
        return cls(ProcessRef.of(pid))

    def live(self) -> bool:
        return self.leader.alive()
