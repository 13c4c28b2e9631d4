"""Cgroup moves kept fast while regions are taken: the daemon's warm pings.

Every cgroup move (a write to ``cgroup.procs``, in any hierarchy) takes the
kernel's ``cgroup_threadgroup_rwsem`` for writing.  Unless the cgroup2 mount
has ``favordynmods``, that rwsem is a per-CPU one whose writer must wait for
an RCU grace period when it has not been taken for writing within about one
grace period: a move after a quiet spell took 7.5-7.8 ms p50 here (up to 15 ms),
a move within a few milliseconds of the last one 0.2-0.3 ms (docs/notes/handoff.md,
"Cgroup moves kept warm").  A region's set-up moves its holder into the slot and
its undo moves it back, so a region taken after a pause — every region of an
agent that compiles and checks between its timings — paid a grace period at
both ends: about 8 ms of set-up during which the device's other jobs are
already frozen, and as much again before the report.

:class:`MoveWarmer` keeps the rwsem in its fast state while it is wanted: a
thread of the daemon moves the daemon's own process into the cgroup it is
already in (a move that changes nothing, and takes the rwsem like any other)
every ``period_s`` (``krex serve --warm-moves-ms``, 4 ms by default: measured
here, pings every 8 ms kept moves fast and every 16 ms was at the edge), from a
region's acquire or release, a job's registration or a program's start in a warm
worker until ``linger_s`` later (``--warm-linger-s``).  An idle daemon pings
nothing.  The daemon's own moves count as pings (:meth:`MoveWarmer.moved`): the
next ping is due a period after the last move of either kind, so a chain of
handoffs (a move every few milliseconds) keeps the rwsem warm by itself and is
not pinged in between — a ping is a cgroup write and ≈ 0.1 ms of a core, on the
cores the handoffs run on.  Costs while warm: one ≈ 30-45 µs write per period (≈ 1 % of one
core), and forks, exits and thread starts on the machine take the rwsem's slower
reader path, as they do for good with ``favordynmods``.  The thread keeps off
the holders' reserved cores.  Where the mount has
``favordynmods`` moves never wait and the warmer stays off.

The daemon's cgroup is read from ``/proc/self/cgroup`` before every ping, so a
daemon that someone else moves is moved only into where it already is (but for a
write that lands within microseconds of that move: it would undo it; so a daemon
that runs inside another krex daemon's tree, which moves its holders in and out
of the frozen subtree, does not ping at all).  A
ping that fails (a cgroup the daemon may not write) turns the warmer off with
the reason; ``krex status`` (``daemon.warm_moves``) shows its state and counts.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from krex.enforce.cgroups import _INSTANCE_DIR, CgroupLayout, favordynmods, write

log = logging.getLogger("krex.warm")

#: ``krex serve --warm-moves-ms`` and ``--warm-linger-s`` by default.
DEFAULT_PERIOD_MS = 4.0
DEFAULT_LINGER_S = 30.0

#: A ping slower than this waited for a grace period (the rwsem had gone idle).
SLOW_PING_MS = 1.5


class MoveWarmer:
    """Keeps cgroup moves fast while :meth:`touch` is called (see the module docstring).
    ``root``/``kind``: the hierarchy whose ``cgroup.procs`` the pings write (``v2``, or a
    v1 controller's name); ``None`` root: off, ``why`` says why."""

    def __init__(self, root: str | None, kind: str, period_s: float, linger_s: float,
                 keep_off: list[int] | tuple = (), why: str = "") -> None:
        self.root, self.kind = root, kind
        self.period_s, self.linger_s = period_s, linger_s
        self.keep_off = list(keep_off)
        self.why = why if root is None else ""
        self.pid = str(os.getpid())
        self.pings = self.slow_pings = 0
        self.ping_ns = 0
        self._until = 0.0
        self._moved = 0.0  # monotonic time of the daemon's last own move (moved())
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_layout(cls, layout: CgroupLayout | None, period_ms: float, linger_s: float,
                   keep_off: list[int] | tuple = ()) -> MoveWarmer:
        """The warmer for this machine: the first writable hierarchy, cgroup2 first."""
        def off(why: str) -> MoveWarmer:
            return cls(None, "", period_ms / 1e3, linger_s, keep_off, why)

        if period_ms <= 0:
            return off("disabled by configuration (--warm-moves-ms 0)")
        if layout is None:
            return off("no cgroups")
        if favordynmods():
            return off("not needed: the cgroup2 mount has favordynmods (moves never wait)")
        for kind, ok in (("v2", layout.v2_writable), ("freezer", layout.freezer_writable),
                         ("cpuset", layout.cpuset_writable)):
            if ok and layout.mounts.get(kind):
                return cls(layout.mounts[kind], kind, period_ms / 1e3, linger_s, keep_off)
        return off("no writable cgroup hierarchy (needs root or a delegated cgroup)")

    # -- the daemon's side -----------------------------------------------------------------

    def start(self) -> None:
        if self.root is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="krex-warm", daemon=True)
        self._thread.start()

    def touch(self) -> None:
        """A region is being taken or given back: keep moves fast for ``linger_s``."""
        if self.root is None:
            return
        self._until = time.monotonic() + self.linger_s
        if not self._wake.is_set():
            self._wake.set()

    def moved(self) -> None:
        """The daemon just moved a process between cgroups (a region's set-up, handoff
        or undo): that took the rwsem as a ping would, so no ping is due for a period."""
        self._moved = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def describe(self) -> dict[str, Any]:
        warm = self.root is not None and time.monotonic() < self._until
        state = "off" if self.root is None else ("warm" if warm else "idle")
        return {"state": state, "why": self.why, "hierarchy": self.kind,
                "period_ms": round(self.period_s * 1e3, 3), "linger_s": self.linger_s,
                "pings": self.pings, "slow_pings": self.slow_pings,
                "ping_mean_us": round(self.ping_ns / self.pings / 1e3, 1) if self.pings else None}

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        if self.keep_off:
            rest = set(os.sched_getaffinity(0)) - set(self.keep_off)
            if rest:
                try:
                    os.sched_setaffinity(0, rest)  # this thread only (Linux)
                except OSError:
                    pass
        while not self._stop.is_set():
            if time.monotonic() >= self._until:
                self._wake.wait()
                self._wake.clear()
                continue
            wait = self._moved + self.period_s - time.monotonic()
            if wait > 0:  # the daemon's own move kept it warm: due a period after it
                self._stop.wait(wait)
                continue
            if not self._ping():
                return
            self._stop.wait(self.period_s)

    def _ping(self) -> bool:
        try:
            path = self._own_procs()
            t0 = time.perf_counter_ns()
            write(path, self.pid)
            dt = time.perf_counter_ns() - t0
        except OSError as exc:
            self.why = f"a ping failed, warming turned off: {exc}"
            log.warning("cgroup warm pings: %s", self.why)
            self.root = None
            return False
        self.pings += 1
        self.ping_ns += dt
        self.slow_pings += dt > SLOW_PING_MS * 1e6
        return True

    def _own_procs(self) -> str:
        """The ``cgroup.procs`` of the cgroup this process is in now."""
        with open("/proc/self/cgroup") as f:
            return self.procs_path(f.read())

    def procs_path(self, proc_self_cgroup: str) -> str:
        """The ``cgroup.procs`` to ping, from ``/proc/self/cgroup``'s text."""
        assert self.root is not None
        for line in proc_self_cgroup.splitlines():
            if line.count(":") >= 2:
                _, names, path = line.split(":", 2)
                if (self.kind == "v2" and not names) or self.kind in names.split(","):
                    if any(_INSTANCE_DIR.match(part) for part in path.split("/")):
                        # another daemon's job or slot: that daemon moves it (a handoff moves
                        # a holder back among the frozen), and a ping that read the slot
                        # just before would move it out again
                        raise PermissionError("this daemon runs inside another krex daemon's "
                                              f"cgroup tree ({path}): not ours to move")
                    return os.path.join(self.root, path.lstrip("/"), "cgroup.procs")
        raise FileNotFoundError(f"this process is in no {self.kind} cgroup")


__all__ = ["DEFAULT_LINGER_S", "DEFAULT_PERIOD_MS", "SLOW_PING_MS", "MoveWarmer"]
