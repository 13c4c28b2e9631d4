"""After a program: is this worker still fit to serve the next one?

``Canary.take(context)`` observes what cannot (or should not) be put back by
``snapshot.restore``: threads, child processes, native libraries, process
attributes (rlimits, niceness, session, dlopen flags), device health and
memory, and krex's own modules (preloaded into every worker: a program that
replaced one of their functions, code objects or class attributes would
otherwise hand the change to the next program).  ``Canary.verdict(before,
after)`` returns ``None`` for a healthy worker, else the recycle reason,
e.g. ``"leaked_thread: Thread-3 (spin)"``.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from krex.enforce.process import task_stat
from krex.workers import fingerprint

_SYSTEM_PREFIXES = tuple(
    {sys.prefix, sys.base_prefix, sys.exec_prefix, "/usr/", "/lib/", "/lib64/", "/opt/"}
)
_RLIMITS = [getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")]


@dataclass
class Canary:
    threads: set[threading.Thread]
    libraries: set[str]
    process: dict[str, Any]
    memory_mb: float | None
    krex: fingerprint.Bindings  # bindings of krex's own modules

    @classmethod
    def take(cls, context: Any) -> Canary:
        taken = cls(threads=set(threading.enumerate()), libraries=native_libraries(),
                    process=process_fingerprint(), memory_mb=context.memory_mb(),
                    krex=fingerprint.fingerprint(fingerprint.krex_modules()))
        _worker_krex[:] = [taken.krex]
        return taken


_worker_krex: list[fingerprint.Bindings] = []  # this worker's canary snapshot of krex


def worker_krex() -> fingerprint.Bindings | None:
    """The bindings of krex's modules as this worker started (checked after every program,
    restored in between), or None outside a worker: :mod:`krex.evaluate.guard` checks
    against it instead of taking the same snapshot again for every evaluation."""
    return _worker_krex[0] if _worker_krex else None


_requested: list[str] = []  # reasons a program's trusted code gave (krex.evaluate's tamper check)


def request_recycle(reason: str) -> None:
    """Ask that this worker be recycled after the current program (e.g. state was tampered with)."""
    _requested.append(reason)


def _take_request() -> str | None:
    reason = _requested[0] if _requested else None
    _requested.clear()
    return reason


def verdict(before: Canary, context: Any, limit_mb: float, check_libraries: bool) -> str | None:
    """The first reason this worker must be recycled, or None."""
    checks = (
        _take_request,
        lambda: _leaked_threads(before.threads),
        _leaked_children,
        lambda: _device_error(context),
        lambda: _memory_growth(before.memory_mb, context, limit_mb),
        lambda: _process_state(before.process),
        lambda: _new_libraries(before.libraries) if check_libraries else None,
        lambda: _krex_modified(before.krex),
    )
    for check in checks:
        reason = check()
        if reason:
            return reason
    return None


def _krex_modified(before: fingerprint.Bindings) -> str | None:
    """Runs after ``snapshot.restore``: module globals are back; what differs now is a
    function's code or defaults, or a class attribute, replaced by the program."""
    changed = before.changed()
    return "krex_modified: " + ", ".join(changed[:3]) if changed else None


def _leaked_threads(before: set[threading.Thread], grace_s: float = 0.05) -> str | None:
    deadline = time.monotonic() + grace_s
    for t in [t for t in threading.enumerate() if t not in before]:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    if not alive:
        return None
    return "leaked_thread: " + ", ".join(t.name for t in alive[:5])


def _leaked_children() -> str | None:
    _reap_exited()
    pids = descendants(os.getpid())
    if not pids:
        return None
    for pid in pids:  # the worker kills what its program left behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap_exited(wait_s=1.0)
    return "leaked_child_process: " + ", ".join(map(str, pids[:5]))


def _reap_exited(wait_s: float = 0.0) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)


def descendants(root: int) -> list[int]:
    """PIDs below ``root``, parents before their children: from each thread's
    ``/proc/PID/task/TID/children`` (the subtree's own files, whatever else the machine
    runs; zombies left out), else from a scan of every process's parent in ``/proc``."""
    try:
        return _children_tree(root)
    except OSError:  # no such files (CONFIG_PROC_CHILDREN off) or root is gone
        return _scanned_tree(root)


def _children_tree(root: int) -> list[int]:
    out, todo, first = [], [root], True
    while todo:
        pid = todo.pop(0)
        kids: list[int] = []
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids += [int(x) for x in f.read().split()]
        except OSError:
            if first:
                raise  # the root's own: fall back
            continue  # a descendant that exited meanwhile
        first = False
        for kid in kids:
            st = task_stat(kid)
            if st is not None and st.state != "Z":  # a zombie is not a leak
                out.append(kid)
                todo.append(kid)
    return out


def _scanned_tree(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = _ppid(int(entry))
            if ppid is not None:
                parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        kids = parents.get(todo.pop(), [])
        out.extend(kids)
        todo.extend(kids)
    return out


def _ppid(pid: int) -> int | None:
    st = task_stat(pid)
    if st is None or st.state == "Z":  # a zombie is not a leak
        return None
    return st.ppid


def _device_error(context: Any) -> str | None:
    problem = context.probe()
    return f"device_error: {problem}" if problem else None


def _memory_growth(before_mb: float | None, context: Any, limit_mb: float) -> str | None:
    now = context.memory_mb()
    if before_mb is None or now is None or now - before_mb <= limit_mb:
        return None
    return f"memory_growth: +{now - before_mb:.0f} MB (limit {limit_mb:.0f} MB)"


def _process_state(before: dict[str, Any]) -> str | None:
    after = process_fingerprint()
    changed = sorted(k for k in before if after.get(k) != before[k])
    return "leaked_state: " + ", ".join(changed) if changed else None


def process_fingerprint() -> dict[str, Any]:
    """Process attributes that are not put back: a change means a fresh process."""
    return {
        "rlimits": tuple(resource.getrlimit(r) for r in _RLIMITS),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "session": (os.getpgid(0), os.getsid(0)),
        "dlopenflags": sys.getdlopenflags(),
        "ids": (os.getuid(), os.geteuid(), os.getgid(), os.getegid()),
    }


def native_libraries() -> set[str]:
    """Shared objects mapped into this process."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
            if ".so" in path and path.startswith("/"):
                out.add(path)
    return out


def _new_libraries(before: set[str]) -> str | None:
    new = sorted(p for p in native_libraries() - before if not p.startswith(_SYSTEM_PREFIXES))
    if not new:
        return None
    return "native_library: " + ", ".join(new[:3]) + " (loaded code cannot be unloaded)"
