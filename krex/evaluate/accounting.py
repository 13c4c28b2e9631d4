"""Work accounting from the kernel: what a callee process and everything it started used.

The candidate's callee is moved into a ``cpuacct`` cgroup (v1) of its own before any
code of the candidate's runs; its threads, forks and double forks stay in it.  The
driver reads the cgroup's CPU time (``cpuacct.usage``, nanoseconds) and the CPU time of
the callee's own threads that existed before the candidate was imported (the
dispatcher's thread, library pools: ``/proc/PID/task/TID/schedstat``) -- the rest is
work the candidate started.  Not a cgroup v2 child of the job's: the daemon moves the
job's own members to the holder's slot for a region and freezes the rest of the
device's subtree, a nested cgroup included (its callee stalled until the region was
revoked).  Without a writable ``cpuacct`` hierarchy the same is read from the
callee's threads alone, and :attr:`Accounting.limitation` says that forks are not seen.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from dataclasses import dataclass

PREFIX = "krex-callee-"  # + the callee's pid + a random tail


@dataclass
class Usage:
    """One reading, in nanoseconds of CPU time."""

    total_ns: int  # the cgroup (or the callee's threads where there is none)
    krex_ns: int  # the threads that existed before the candidate was imported
    processes: int  # processes in the cgroup (1: the callee alone; 0 unknown)
    threads: int  # threads in the cgroup (or the callee)

    @property
    def candidates_ns(self) -> int:
        return max(0, self.total_ns - self.krex_ns)


def _cpuacct_root() -> str | None:
    """Where the v1 ``cpuacct`` hierarchy is mounted (None: not on this machine)."""
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 3 and parts[2] == "cgroup" and "cpuacct" in parts[3].split(","):
                return parts[1]
    return None


def _own_cpuacct() -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "cpuacct" in controllers.split(","):
                return path
    return "/"


def _task_ns(pid: int, tid: int) -> int:
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def sweep(parent: str) -> list[str]:
    """Remove the callee cgroups of callees that are gone (a driver killed before it
    could remove its own); returns what was removed.  Only empty ones of dead pids."""
    removed = []
    for name in os.listdir(parent):
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if os.path.exists(f"/proc/{pid}"):
            continue  # its callee (or a reused pid: left for a later sweep)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(parent, name))  # refused while a process is in it
            removed.append(name)
    return removed


def tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


class Accounting:
    """The kernel's view of one callee: create it for the callee's pid before it runs
    anything of the task's, call :meth:`baseline` once it is bound (before the
    candidate's import), then :meth:`read` between calls."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.path: str | None = None
        self.limitation: str | None = None
        self.krex_tids: list[int] = [pid]
        try:
            root = _cpuacct_root()
            if root is None:
                raise OSError("no cpuacct hierarchy mounted")
            parent = os.path.join(root, _own_cpuacct().lstrip("/"))
            sweep(parent)
            path = os.path.join(parent, f"krex-callee-{pid}-{secrets.token_hex(3)}")
            os.mkdir(path)
            self.path = path
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        except OSError as exc:
            self.close()
            self.limitation = f"no cgroup of its own ({exc}): threads are read from " \
                              "/proc, forks are not seen"

    def baseline(self) -> None:
        """The callee's threads now (bound, the candidate not yet imported) are krex's."""
        self.krex_tids = tasks(self.pid) or [self.pid]

    def read(self) -> Usage:
        krex = sum(_task_ns(self.pid, t) for t in self.krex_tids)
        if self.path is not None:
            try:
                return Usage(self._usage_ns(), krex, self._count("cgroup.procs"),
                             self._count("tasks"))
            except (OSError, ValueError):
                pass
        tids = tasks(self.pid)
        return Usage(sum(_task_ns(self.pid, t) for t in tids), krex, 0, len(tids))

    def _usage_ns(self) -> int:
        assert self.path is not None
        with open(os.path.join(self.path, "cpuacct.usage")) as f:
            return int(f.read())

    def _count(self, name: str) -> int:
        assert self.path is not None
        with open(os.path.join(self.path, name)) as f:
            return sum(1 for line in f if line.strip())

    def kill_all(self) -> None:
        """SIGKILL every process in the cgroup (double forks included)."""
        if self.path is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
            return
        for _ in range(5):  # v1 has no cgroup.kill: forks may race the kill
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(self.path, "cgroup.procs")) as f:
                    pids = [int(p) for p in f.read().split()]
                for p in pids:
                    with contextlib.suppress(OSError):
                        os.kill(p, signal.SIGKILL)
                if not pids:
                    return
            time.sleep(0.01)

    def meter(self) -> GapMeter | None:
        """A cheap reader for every call boundary (None without a cgroup)."""
        if self.path is None:
            return None
        try:
            return GapMeter(os.path.join(self.path, "cpuacct.usage"),
                            [f"/proc/{self.pid}/task/{t}/schedstat" for t in self.krex_tids])
        except OSError:
            return None

    def close(self) -> None:
        """Remove the cgroup (once it is empty; waits briefly for the killed to go)."""
        if self.path is None:
            return
        for _ in range(50):
            try:
                os.rmdir(self.path)
                break
            except OSError:
                time.sleep(0.01)
        self.path = None


class GapMeter:
    """The candidate's own threads' and processes' CPU time between its calls: read
    (``pread`` on open files, a few microseconds, never inside a timed span) when a call
    returns and before the next one starts; what krex's threads (the dispatcher's
    after-work) used in between is not the candidate's."""

    def __init__(self, usage: str, krex: list[str]) -> None:
        self.fds = [os.open(usage, os.O_RDONLY)]
        for path in krex:
            with contextlib.suppress(OSError):
                self.fds.append(os.open(path, os.O_RDONLY))
        self.outside_ns, self.gaps = 0, 0
        self._returned: int | None = None

    def _candidates_ns(self) -> int | None:
        try:
            total = int(os.pread(self.fds[0], 64, 0))
            krex = sum(int(os.pread(fd, 128, 0).split()[0]) for fd in self.fds[1:])
        except (OSError, ValueError, IndexError):
            return None
        return total - krex

    def returned(self) -> None:
        """A call of the candidate's just returned."""
        self._returned = self._candidates_ns()

    def starting(self) -> None:
        """A call of the candidate's is about to start: the gap since it last returned."""
        now = self._candidates_ns()
        if now is not None and self._returned is not None:
            self.outside_ns += max(0, now - self._returned)
            self.gaps += 1
        self._returned = None

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
