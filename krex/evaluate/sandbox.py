"""The candidate's sandbox in a sealed evaluation: what its callee process may reach.

The trusted driver starts the candidate's callee (:mod:`krex.evaluate.callees`)
through a :class:`Sandbox`, which it plans before the start and releases after:

- **A uid of its own.**  Where the driver is root (the daemon's own warm workers on
  a root node), the candidate runs as the first uid of ``KREX_SANDBOX_UIDS``
  (61000-61999) that no account has, no process runs as and no other evaluation
  holds (a lock in ``/run/krex-sandbox``, held until its callee is dead), with a
  group of the same number and no other: it cannot read the driver's or the
  reference's memory, signal them, read another user's owner-only files or connect
  to the daemon's socket.  Only if that uid can run the interpreter and read the
  candidate's files; where the driver is not root, the candidate keeps its uid.
- **No network.**  A network namespace of its own (a user namespace too where the
  driver is not root): a loopback that is down, no route out, none of the host's
  abstract sockets.
- **A private writable tmp.**  ``TMPDIR`` (and ``HOME`` when it runs apart) is a
  fresh owner-only directory, removed after the evaluation.
- **Limits** (``setrlimit``): no core files, files up to 1 GiB, address space up to
  the machine's memory, CPU time up to the evaluation's timeout on every CPU, and
  512 processes and threads where it has a uid of its own (the limit is per uid).
- **Signals to itself only** (a seccomp filter, :func:`signal_filter`): ``kill``,
  ``tgkill`` and ``rt_(tg)sigqueueinfo`` only at its own pid, no ``tkill`` or
  ``pidfd_send_signal``: a candidate of the driver's uid cannot stop the reference
  (which would slow it) or the driver.  Its own children cannot be signalled either.

Whatever could not be applied is named in :attr:`SandboxReport.missing`, which the
evaluation's record carries (``integrity.sandbox``); ``sandbox="required"`` refuses
to run the evaluation instead.  The reference's callee, and the driver during a
sealed evaluation, are not dumpable (``PR_SET_DUMPABLE`` 0): a candidate that runs as
their uid still cannot read their memory or open their descriptors through ``/proc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib.util
import os
import platform
import resource
import shutil
import stat
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from krex.protocol.runas import SANDBOX_UIDS, RunAs, has_account, running_uids, uid_range

MODES = ("auto", "required", "off")
UIDS_ENV = "KREX_SANDBOX_UIDS"
LOCK_DIR = "/run/krex-sandbox"
FILE_BYTES = 1 << 30
PROCESSES = 512  # threads count too (RLIMIT_NPROC is per uid)
CPU_SLACK_S = 10
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
# Signal system calls by architecture: (audit arch, {to a pid: [nr]}, [refused outright])
SIGNALS = {
    "x86_64": (0xC000003E, [62, 129, 234, 297], [200, 424]),  # kill rt_sigqueueinfo tgkill
    # rt_tgsigqueueinfo; tkill pidfd_send_signal
    "aarch64": (0xC00000B7, [129, 138, 131, 240], [130, 424]),
}


class SandboxUnavailable(Exception):
    """``sandbox="required"`` and a part of it cannot be applied here."""


@dataclass
class SandboxReport:
    """What the candidate's process ran under: the record's ``integrity.sandbox``."""

    mode: str  # auto | required | off
    uid: int  # the candidate's uid
    apart: bool  # a uid of its own: not the driver's, not the reference's
    network: str  # "none" (a namespace of its own) or "shared"
    signals: str  # "own" (it may signal only itself) or "any"
    tmp: str | None  # its private TMPDIR (None: off)
    limits: dict[str, int] = field(default_factory=dict)  # RLIMIT_* -> the value set
    missing: list[str] = field(default_factory=list)  # what could not be applied, and why

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dumpable(on: bool) -> None:
    """Not dumpable: this process's memory and descriptors unreadable through ``/proc``
    and ``ptrace`` by anyone without ``CAP_SYS_PTRACE``, its own uid's processes too."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, int(on), 0, 0, 0)


def is_dumpable() -> bool:
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(3, 0, 0, 0, 0))  # PR_GET_DUMPABLE
    except (OSError, AttributeError):
        return True


class Sandbox:
    """One candidate callee's sandbox: :meth:`preexec` and :meth:`env` for its start,
    :meth:`started` right after it, :meth:`close` once it is dead."""

    def __init__(self, mode: str, reach: list[str], cpu_s: float) -> None:
        if mode not in MODES:
            raise ValueError(f"sandbox must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.run_as: RunAs | None = None
        self.lock_fd = -1
        self.tmp: str | None = None
        self.limits: dict[str, int] = {}
        self.missing: list[str] = []
        self._said_r = self._said_w = -1
        if mode == "off":
            self.missing.append("off: asked for (sandbox='off')")
            return
        self.tmp = tempfile.mkdtemp(prefix="krex-candidate-")
        if os.geteuid() == 0:
            self._claim(reach)
        else:
            self.missing.append(f"uid: the driver runs as uid {os.geteuid()}, not root: the "
                                "candidate runs as its uid (the driver and the reference "
                                "are not dumpable and it may signal only itself: their "
                                "memory stays unreadable and they cannot be stopped)")
        self.limits = {"RLIMIT_CORE": 0, "RLIMIT_FSIZE": FILE_BYTES,
                       "RLIMIT_AS": _memory_bytes(),
                       "RLIMIT_CPU": int(cpu_s * (os.cpu_count() or 1)) + CPU_SLACK_S}
        if self.run_as is not None:
            self.limits["RLIMIT_NPROC"] = PROCESSES
            self.run_as.give(self.tmp)
        else:
            self.missing.append("processes: no limit (RLIMIT_NPROC counts every process "
                                "of the uid, the driver's too)")
        self.limits = {name: _within_hard(name, v) for name, v in self.limits.items()}
        self._said_r, self._said_w = os.pipe()
        if mode == "required" and self.missing:
            why = "; ".join(self.missing)
            self.close()
            raise SandboxUnavailable(why)

    def _claim(self, reach: list[str]) -> None:
        """The first free uid of the range, locked for this evaluation, if it can reach
        the files the callee must read."""
        text = os.environ.get(UIDS_ENV) or SANDBOX_UIDS
        try:
            uids = uid_range(text, UIDS_ENV)
            _lock_dir()
        except (ValueError, OSError) as exc:
            self.missing.append(f"uid: {exc}")
            return
        busy = running_uids()
        for uid in uids:
            if uid in busy or has_account(uid):
                continue
            fd = os.open(os.path.join(LOCK_DIR, str(uid)),
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            run_as = RunAs(uid=uid, gid=uid, groups=(), home=self.tmp or "/")
            why = run_as.cannot_reach(reach, [])
            if why is not None:
                os.close(fd)
                self.missing.append(f"uid: the candidate would run as uid {uid}, but {why}")
                return
            self.lock_fd, self.run_as = fd, run_as
            return
        self.missing.append(f"uid: none free in {UIDS_ENV} {text}")

    def preexec(self) -> Callable[[], None] | None:
        """The callee's ``preexec_fn``: its namespaces, limits and user.  Made here, in the
        parent: a forked child of a threaded process looks nothing up."""
        if self.mode == "off":
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        unshare, prctl = libc.unshare, libc.prctl
        become = self.run_as.preexec() if self.run_as is not None else None
        limits = [(getattr(resource, name), v) for name, v in self.limits.items()]
        said, root = self._said_w, os.geteuid() == 0
        uid, gid = os.getuid(), os.getgid()
        table = SIGNALS.get(platform.machine())

        def child() -> None:
            prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # the driver's flag, forked: /proc/self root's
            if unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET) != 0:
                os.write(said, f"network: unshare: {os.strerror(ctypes.get_errno())}\n"
                         .encode())
            elif not root:
                _identity_map(uid, gid)
            for which, value in limits:
                resource.setrlimit(which, (value, value))
            if become is not None:
                become()
            if table is None:
                os.write(said, f"signals: no filter for {platform.machine()}\n".encode())
                return
            program = signal_filter(os.getpid(), *table)
            prog = ctypes.create_string_buffer(program)
            fprog = struct.pack("HxxxxxxP", len(program) // 8, ctypes.addressof(prog))
            if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or prctl(
                    PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0) != 0:
                os.write(said, f"signals: seccomp: {os.strerror(ctypes.get_errno())}\n"
                         .encode())

        return child

    def env(self, base: dict[str, str]) -> dict[str, str]:
        if self.tmp is None:
            return dict(base)
        out = {**base, "TMPDIR": self.tmp}
        if self.run_as is not None:
            out.update(self.run_as.env())
        return out

    def started(self) -> SandboxReport:
        """What the callee now runs under (call once it is started); ``required`` and a
        part that failed in the child: :class:`SandboxUnavailable`."""
        said = ""
        if self._said_w >= 0:
            os.close(self._said_w)
            self._said_w = -1
            said = _read_all(self._said_r)
            os.close(self._said_r)
            self._said_r = -1
        missing = self.missing + [line for line in said.splitlines() if line]
        network = "shared" if self.mode == "off" or "network:" in said else "none"
        signals = "any" if self.mode == "off" or "signals:" in said else "own"
        report = SandboxReport(
            mode=self.mode, uid=self.run_as.uid if self.run_as else os.getuid(),
            apart=self.run_as is not None, network=network, signals=signals, tmp=self.tmp,
            limits=dict(self.limits), missing=missing)
        if self.mode == "required" and missing:
            raise SandboxUnavailable("; ".join(missing))
        return report

    def close(self) -> None:
        """After the callee and everything it started are dead: its tmp goes, its uid is free."""
        for fd in (self._said_r, self._said_w):
            if fd >= 0:
                os.close(fd)
        self._said_r = self._said_w = -1
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def signal_filter(pid: int, arch: int, to_pid: list[int], refused: list[int]) -> bytes:
    """A seccomp program (classic BPF) letting ``pid`` signal only itself: the system
    calls in ``to_pid`` are allowed when their first argument is ``pid``, those in
    ``refused`` never (``EPERM``); other architectures' calls (x32's too) are refused
    outright, every other call is allowed."""
    ld_w_abs, jeq_k, jge_k, ret_k = 0x20, 0x15, 0x35, 0x06
    allow, eperm, kill = 0x7FFF0000, 0x00050000 | 1, 0x80000000  # KILL_PROCESS
    code: list[tuple[int, int, int, int]] = [(ld_w_abs, 0, 0, 4), (jeq_k, 1, 0, arch),
                                             (ret_k, 0, 0, kill), (ld_w_abs, 0, 0, 0),
                                             (jge_k, 0, 1, 0x40000000), (ret_k, 0, 0, eperm)]
    checks = [(nr, True) for nr in to_pid] + [(nr, False) for nr in refused]
    n = len(checks)
    for i, (nr, by_pid) in enumerate(checks):  # a match jumps to the pid check or the refusal
        code.append((jeq_k, n - i if by_pid else n - i + 3, 0, nr))
    code += [(ret_k, 0, 0, allow),  # none of them
             (0x20, 0, 0, 16), (jeq_k, 0, 1, pid & 0xFFFFFFFF),  # args[0]'s low word
             (ret_k, 0, 0, allow), (ret_k, 0, 0, eperm)]
    return b"".join(struct.pack("HBBI", c, jt, jf, k) for c, jt, jf, k in code)


def reach(fn_paths: list[str]) -> list[str]:
    """The files a callee must read: the interpreter (and its venv), krex and its native
    dispatcher, numpy, torch where it is loaded, and the task's own files."""
    files = [sys.executable, os.path.realpath(sys.executable)]
    cfg = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "pyvenv.cfg")
    files += [cfg] if os.path.exists(cfg) else []
    for name in ("krex", "krex._native._dispatch", "numpy",
                 *(["torch"] if "torch" in sys.modules else [])):
        found = importlib.util.find_spec(name)
        if found is not None and found.origin:
            files.append(found.origin)
    return files + list(fn_paths)


def _lock_dir() -> None:
    """``/run/krex-sandbox``: root's alone (a directory anyone else made is refused)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(LOCK_DIR, 0o700)
    st = os.lstat(LOCK_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
        raise OSError(f"{LOCK_DIR} is not a directory of root's alone "
                      f"({stat.filemode(st.st_mode)}, uid {st.st_uid})")


def _identity_map(uid: int, gid: int) -> None:
    """In a new user namespace: the same uid and gid inside as outside."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _within_hard(name: str, value: int) -> int:
    """``value``, or the hard limit already set where that is lower (only root raises it)."""
    _, hard = resource.getrlimit(getattr(resource, name))
    return value if hard == resource.RLIM_INFINITY else min(value, hard)


def _read_all(fd: int) -> str:
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks).decode("utf-8", "replace")
        chunks.append(chunk)
