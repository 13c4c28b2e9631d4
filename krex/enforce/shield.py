"""The shield: tasks krex does not manage kept off the holder's reserved cores.

:class:`~krex.enforce.isolation.CpuIsolation` moves krex's own jobs; everything
else on the machine (other users' programs, services, shells) is the shield's.
In: the cgroup layout, the guardian, the holder and its reserved cores.  Out:
one :class:`ShieldRegion` operation per region and the ``shield`` part of the
region report's host evidence (what was shielded, what was exempt, and where
nothing could be done, a ``not_enforced`` code with a one-line ``why``).

Mode ``cpuset-shield`` (cgroup v1 cpuset, root): at a daemon's first region a
krex-owned "rest" cpuset ``<cpuset>/krex-shield<pid>-<start>`` is made with
every core, and every movable task of the root cpuset is moved into it once
(children inherit it; each later region sweeps the root's ``cgroup.procs``
for stragglers).  During a region the rest cpuset's ``cpuset.cpus`` is
narrowed to the cores not reserved (one write: the kernel moves every member
at once, even tasks pinned to a reserved core; since Linux 6.2 it also gives
them back their own affinity when the cores come back) and restored after.
The rest cpuset lives as long as the daemon: a guardian lease of its own
(:data:`SHIELD_LEASE_ID`, ``shield_release``) moves every task back to the
root cpuset and removes it when the daemon stops or dies; a new daemon's
cgroup sweep removes one whose owner is dead.

Tasks in other cpusets (another krex daemon's jobs, a container's cpuset)
stay where they are, but each such cpuset whose tasks may run on a reserved
core is narrowed for the region (children before parents; ``narrowed``) and
given its cores back after, unless its owner changed them meanwhile (undo
records restore them after a crash).  One left with only reserved cores, or
that refuses, is named in ``unshielded``.  Not moved, and named: kernel
threads (per-CPU ones bound to a reserved core are listed in ``exempt``),
PID 1, the holder's own processes and cpuset, this daemon's own job cpusets
(:class:`~krex.enforce.isolation.CpuIsolation` places those).

Only one daemon on the machine owns the shield at a time (``flock`` on
:func:`lock_path`, which names the owner's pid); another daemon's regions
report ``not_enforced: held`` and ``why: held by krex daemon pid N``.  The
shield is chosen by ``KREX_SHIELD`` (``auto`` default, ``on``, ``off``, ``affinity``).
Mode ``affinity`` (root without a writable v1 cpuset, e.g. pure cgroup v2;
``KREX_SHIELD=affinity`` forces it): :mod:`krex.enforce.affinityshield`.
cgroup v2 cpuset partitions are not implemented yet.  Without root the mode
is ``none`` with the reason (``krex doctor`` says which mode the machine
supports).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import threading
import time
from typing import Any

from krex.enforce.cgroups import instance_name, read, write
from krex.enforce.isolation import _cpulist as _isolation_cpulist
from krex.enforce.isolation import _parse_cpulist
from krex.enforce.process import task_stat

ENV = "KREX_SHIELD"
MODES = ("auto", "on", "off", "affinity")  # affinity: the fallback even with a cpuset
SHIELD_LEASE_ID = 0  # the daemon's long-lived lease: below every region's (1, 2, ...)
LEASE_S = 10 * 365 * 86400.0  # the shield lives until the daemon goes: no expiry
RELEASE = "shield_release"
_PF_KTHREAD = 0x00200000
_PF_NO_SETAFFINITY = 0x04000000
_LISTED = 32  # names in ``exempt`` / ``unshielded`` at most
KTHREADS_FRESH_S = 1.0  # known kernel threads trusted for this long after a scan (below)
LINGER_ENV = "KREX_SHIELD_LINGER_MS"
LINGER_MS = 50.0  # the shield stays narrowed this long after a region nobody follows
# A narrowing carried from region to region (handed over, or taken over from a linger)
# looks for cpusets made since it was planned at most this often: a walk of the cpuset
# tree is not for every grant, and one made meanwhile is the contention judge's until then.
RECHECK_S = 1.0
PARK_LEASE_BASE = 1 << 40  # lease ids of a lingering shield: above every region's
PARK_LEASE_MARGIN_S = 5.0  # the guardian widens a lingering shield the daemon forgot
_park_ids = itertools.count(1)


def configured_mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    return mode if mode in MODES else "auto"


def configured_linger_s() -> float:
    """How long a region's narrowing outlives it when no region follows at once
    (``KREX_SHIELD_LINGER_MS``, default 50 ms, 0: widen at every region's end; at most
    10 s)."""
    try:
        ms = float(os.environ.get(LINGER_ENV, LINGER_MS))
    except ValueError:
        ms = LINGER_MS
    return min(max(ms, 0.0), 10000.0) / 1e3 if ms == ms else LINGER_MS / 1e3


def lock_path() -> str:
    base = "/run/lock" if os.access("/run/lock", os.W_OK) else "/tmp"
    return os.environ.get("KREX_SHIELD_LOCK", os.path.join(base, "krex-shield.lock"))


def machine_mode(layout: Any, configured: str = "auto") -> dict[str, str]:
    """What this machine supports: ``mode`` (cpuset-shield | affinity | none), and for
    none a ``not_enforced`` code and a one-line ``why``."""
    if os.geteuid() != 0:
        return _none("not_root", "moving other users' tasks off cores needs root")
    if layout is not None and layout.cpuset and layout.cpuset_writable \
            and configured != "affinity":
        return {"mode": "cpuset-shield", "not_enforced": "", "why": "",
                "cpuset": layout.cpuset}
    why = ("" if configured == "affinity" else "no writable cgroup v1 cpuset"
           + (" (cgroup v2 cpuset partitions are not implemented yet)"
              if layout is not None and layout.v2_cpuset else "")
           + ": every movable thread's affinity instead")
    return {"mode": "affinity", "not_enforced": "", "why": why}


def _none(code: str, why: str) -> dict[str, str]:
    return {"mode": "none", "not_enforced": code, "why": why}


# -- tasks ----------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(comm, flags) of a task, None when gone."""
    try:
        st = task_stat(pid)
    except OSError:
        return None
    return (st.comm, st.flags) if st else None


def _procs(d: str) -> list[int]:
    try:
        return [int(x) for x in read(os.path.join(d, "cgroup.procs")).split()]
    except (OSError, ValueError):
        return []


def _cpuset_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cpuset") as f:
            return f.read().strip()
    except OSError:
        return None


def _cpulist(cores: list[int]) -> str:
    return _isolation_cpulist(sorted(cores))


parse_cpulist = _parse_cpulist  # "0-2,5" -> [0, 1, 2, 5] (isolation's parser)


def exempt_kernel_threads(root: str, cores: list[int]) -> tuple[list[str], int]:
    """Kernel threads of the root cpuset: (``"pid comm"`` of those bound to a reserved
    core, count of the rest, which the kernel places itself)."""
    bound, others = [], 0
    for pid in _procs(root):
        st = _stat(pid)
        if st is None or not st[1] & _PF_KTHREAD:
            continue
        try:
            mask = os.sched_getaffinity(pid)
        except OSError:
            continue
        if st[1] & _PF_NO_SETAFFINITY and mask <= set(cores):
            bound.append(f"{pid} {st[0]}")
        else:
            others += 1
    return bound, others


# -- the shield (one per daemon) ------------------------------------------------------


class Shield:
    """The daemon's shield: lock, rest cpuset and guardian lease, made at first use."""

    def __init__(self, layout: Any, guardian: Any = None, mode: str | None = None) -> None:
        self.layout = layout
        self.guardian = guardian
        self.mode = mode or configured_mode()
        self.root = layout.cpuset if layout is not None else None
        self.all_cores = sorted(os.sched_getaffinity(0))
        self.path: str | None = None  # the rest cpuset, once made
        self.all_cpus = ""
        self._lock_fd: int | None = None
        self._refused: dict[str, str] | None = None
        self._exempt: tuple[float, tuple[int, ...], tuple[list[str], int]] | None = None
        self._kthreads: set[int] = set()  # kernel threads seen in the root cpuset
        self._kthreads_seen = 0.0
        self.devices: set[int] = set()  # fake devices' servers: the device, not host tasks
        # The linger (see :meth:`park`): one lock for every narrow and widen of the rest
        # cpuset, so a linger's end never widens under a region that took it over.
        self.lock = threading.RLock()
        self.linger_s = configured_linger_s()
        self.parked: ShieldRegion | None = None
        self._park_lease: int | None = None
        self._park_until = 0.0
        self._wake = threading.Condition(self.lock)
        self._lingerer: threading.Thread | None = None

    def user_tasks(self, pids: list[int]) -> list[int]:
        """The PIDs of ``pids`` (the root cpuset's) that are not kernel threads, > 1.

        The root cpuset holds every kernel thread (dozens here): reading each one's
        ``/proc/PID/stat`` at every region's start and end cost ≈ 1.5 ms per region.
        A PID seen as a kernel thread is trusted as one while it stays in the list,
        if the previous scan was less than :data:`KTHREADS_FRESH_S` ago: for a
        user task to take its PID meanwhile, the kernel thread must exit (leaving
        the list, so forgotten at the next scan) and the PID space (``pid_max``)
        wrap around within that second.  After a longer gap every PID is read again."""
        now = time.monotonic()
        present = set(pids)
        known = self._kthreads & present if now - self._kthreads_seen < KTHREADS_FRESH_S \
            else set()
        out = []
        for pid in pids:
            if pid <= 1 or pid in known:
                continue
            st = _stat(pid)
            if st is None:
                continue
            if st[1] & _PF_KTHREAD:
                known.add(pid)
            else:
                out.append(pid)
        self._kthreads, self._kthreads_seen = known, now
        return out

    def exempt_device(self, pid: int) -> None:
        """A fake device's server (fakegpu) is the device, not a task on the host: never
        swept or narrowed.  Its execution thread pins itself off the reserved cores; its
        serving threads do what a driver does in the caller's thread, so they may run
        where the holder runs.  Taken out of the rest cpuset if it was born there (its
        pinned thread keeps its own affinity through the move, Linux >= 6.2).  The serving
        threads keep off the device's own core themselves (native/fakegpu/server.c)."""
        self.devices.add(pid)
        if self.path is None or self.root is None:
            return
        if _cpuset_of(pid) == "/" + os.path.relpath(self.path, self.root):
            with contextlib.suppress(OSError):
                write(os.path.join(self.root, "cgroup.procs"), str(pid))

    def status(self, acquire: bool = True) -> dict[str, Any]:
        """``mode`` and, when the shield cannot act, ``not_enforced`` and ``why``
        (``acquire``: take the machine-wide lock if nobody holds it)."""
        if self.mode == "off":
            return _none("disabled", f"disabled by configuration ({ENV}=off)")
        machine = machine_mode(self.layout, self.mode)
        if machine["mode"] == "none":
            return machine
        if self._lock_fd is None and not acquire and self._refused is None:
            return _none("not_applied", "no reserved cores this region (isolation off)")
        if self._lock_fd is None and not self._acquire():
            assert self._refused is not None
            return self._refused
        return {"mode": machine["mode"], "not_enforced": "", "why": machine["why"]}

    def usable(self) -> bool:
        return self.status()["mode"] != "none"

    def _acquire(self) -> bool:
        """The machine-wide lock; False (and why, naming the owner) when another holds it."""
        path = lock_path()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self._refused = _none("no_lock", f"cannot open {path}: {e}")
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            self._refused = _none("held", f"held by krex daemon pid {owner} (one shield "
                                  "per machine)")
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd, self._refused = fd, None
        return True

    def establish(self) -> None:
        """Make the rest cpuset (every core) and lease its release to the guardian."""
        if self.path is not None:
            return
        assert self.root is not None
        path = os.path.join(self.root, "krex-" + instance_name("shield"))
        os.makedirs(path, exist_ok=True)
        with contextlib.suppress(OSError):  # no scheduler-domain rebuild per write
            write(os.path.join(path, "cpuset.sched_load_balance"), "0")
        self.all_cpus = read(os.path.join(self.root, "cpuset.cpus"))
        write(os.path.join(path, "cpuset.mems"), read(os.path.join(self.root, "cpuset.mems")))
        write(os.path.join(path, "cpuset.cpus"), self.all_cpus)
        self.path = path
        if self.guardian is not None:
            self.guardian.lease(SHIELD_LEASE_ID, LEASE_S, self.release_records())

    def release_records(self) -> list[dict]:
        return [{"kind": RELEASE, "path": self.path, "root": self.root}]

    def sweep(self, exclude: set[int]) -> tuple[int, list[int]]:
        """Move every movable task of the root cpuset into the rest cpuset:
        (moved, pids that refused)."""
        assert self.root is not None and self.path is not None
        moved, refused = 0, []
        target = os.path.join(self.path, "cgroup.procs")
        for pid in self.user_tasks(_procs(self.root)):
            if pid in exclude or pid in self.devices:
                continue
            try:
                write(target, str(pid))
                moved += 1
            except ProcessLookupError:
                pass
            except OSError:
                refused.append(pid)
        return moved, refused

    def exempt(self, cores: list[int]) -> tuple[list[str], int]:
        """:func:`exempt_kernel_threads`, looked up again at most every 10 s (kernel
        threads come and go rarely; the scan costs a millisecond per region)."""
        assert self.root is not None
        now = time.monotonic()
        if self._exempt is None or self._exempt[1] != tuple(cores) or now - self._exempt[0] > 10:
            self._exempt = (now, tuple(cores), exempt_kernel_threads(self.root, cores))
        return self._exempt[2]

    def narrow(self, cpus: list[int]) -> None:
        assert self.path is not None
        write(os.path.join(self.path, "cpuset.cpus"), _cpulist(cpus))

    def widen(self) -> None:
        if self.path is not None:
            write(os.path.join(self.path, "cpuset.cpus"), self.all_cpus)

    # -- the linger -----------------------------------------------------------------------

    def park(self, region: ShieldRegion) -> bool:
        """Keep ``region``'s narrowing for :attr:`linger_s` after it ended (called under
        :attr:`lock`): the next region on the same cores within that time takes it
        over (:meth:`take_parked`) instead of widening then sweeping and narrowing again
        (≈ 1.8 ms of each set-up gap here).  Leased to the guardian with the region's
        undo records (widen, other cpusets' cores back) and an expiry of the linger
        plus a margin, so a daemon that dies or hangs meanwhile leaves nothing
        narrowed; a thread widens it when the linger is over.  False: not kept (linger
        off, or one is kept already)."""
        if self.linger_s <= 0 or self.parked is not None or self.path is None:
            return False
        lease = PARK_LEASE_BASE + next(_park_ids)
        if self.guardian is not None:
            self.guardian.lease(lease, self.linger_s + PARK_LEASE_MARGIN_S,
                                region.undo_records())
        self.parked, self._park_lease = region, lease
        self._park_until = time.monotonic() + self.linger_s
        if self._lingerer is None:  # one thread for every linger: starting a thread per
            self._lingerer = threading.Thread(  # park waited ≈ 1 ms for it on a loaded core
                target=self._linger_loop, name="krex-shield-linger", daemon=True)
            self._lingerer.start()
        else:
            self._wake.notify()
        return True

    def _linger_loop(self) -> None:
        """Widen a lingering narrowing when its time is over (one daemon thread)."""
        with self.lock:
            while True:
                if self.parked is None or self._park_lease is None:
                    self._wake.wait()
                    continue
                left = self._park_until - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                try:
                    self._linger_over(self._park_lease)
                except Exception:  # noqa: BLE001 - the thread must outlive it; the
                    self.parked = None  # guardian's lease widens what is left

    def peek_parked(self, cores: list[int]) -> ShieldRegion | None:
        with self.lock:
            p = self.parked
            return p if p is not None and p.cores == sorted(cores) else None

    def take_parked(self, cores: list[int]) -> ShieldRegion | None:
        """The lingering narrowing for ``cores``, now the caller's (under :attr:`lock`;
        the caller, once its own lease holds the same records, calls
        :meth:`end_park_lease`)."""
        p = self.peek_parked(cores)
        if p is None:
            return None
        self.parked = None
        if self._park_expired():  # widened by the guardian: nothing left to take over
            self.end_park_lease()
            return None
        return p

    def _park_expired(self) -> bool:
        """The guardian already undid it (the daemon was late by the margin)."""
        if self.guardian is None or self._park_lease is None:
            return False
        return self._park_lease in self.guardian.expired()

    def end_park_lease(self) -> None:
        lease, self._park_lease = self._park_lease, None
        if lease is not None and self.guardian is not None:
            with contextlib.suppress(Exception):  # stopping: the guardian undoes it anyway
                self.guardian.end(lease)

    def _linger_over(self, lease: int) -> None:
        with self.lock:
            if self.parked is None or self._park_lease != lease:
                return  # taken over meanwhile
            region, self.parked = self.parked, None
            with contextlib.suppress(OSError):
                region.widen()
            self.end_park_lease()

    def unpark(self) -> None:
        """Widen a lingering narrowing now (the daemon stops)."""
        with self.lock:
            if self.parked is not None and self._park_lease is not None:
                try:
                    self._linger_over(self._park_lease)
                except Exception:  # noqa: BLE001 - the thread must outlive it; the
                    self.parked = None  # guardian's lease widens what is left

    def close(self) -> None:
        """Dissolve the rest cpuset, end the lease, let go of the lock."""
        self.unpark()
        if self.path is not None:
            release(self.path, self.root or "")
            if self.guardian is not None:
                with contextlib.suppress(Exception):
                    self.guardian.end(SHIELD_LEASE_ID)
            self.path = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def ops(self, holder: Any, cores: list[int], pids: set[int] | None = None) -> list[Any]:
        """The region's shield operation, or none when the shield cannot act.  ``pids``:
        the holder's processes, read before the slot move empties its job cgroup (then
        finding them again would take a ``/proc`` scan)."""
        if not cores:
            return []
        mode = self.status()["mode"]
        if mode == "affinity":
            from krex.enforce.affinityshield import AffinityRegion

            return [AffinityRegion(holder, cores, self.all_cores, self.devices)]
        if mode != "cpuset-shield":
            return []
        region = ShieldRegion(self, holder, cores)
        region._pids = set(pids or ())
        parked = self.peek_parked(cores)
        if parked is not None:  # its plan, so the lease before apply needs no cpuset walk
            region._foreign, region._planned = parked._foreign, parked._planned
        return [region]

    def foreign(self, cores: list[int], managed: set[str]) -> list[tuple[str, str, int]]:
        """Cpusets other than the root, the rest and this daemon's own (``managed``)
        whose tasks may run on ``cores``: ``(dir, cpuset.cpus, tasks)``, children
        before their parents (the order to narrow them in)."""
        assert self.root is not None
        out = []
        for d, _dirs, _ in os.walk(self.root, topdown=False):
            if d in (self.root, self.path) or any(d == m or d.startswith(m + "/")
                                                  for m in managed):
                continue
            try:
                cpus = read(os.path.join(d, "cpuset.cpus"))
            except OSError:
                continue
            tasks = len(_procs(d))
            if tasks and set(parse_cpulist(cpus)) & set(cores):
                out.append((d, cpus, tasks))
        return out


class ShieldRegion:
    """One region's shield: sweep stragglers in, narrow the rest cpuset, widen after."""

    name = "shield"
    keepable = True  # with checkpoint() and renew(): krex.daemon.keep
    backend = "cpuset-shield"

    def __init__(self, shield: Shield, holder: Any, cores: list[int]) -> None:
        self.shield = shield
        self.holder = holder
        self.cores = sorted(cores)
        self.evidence: dict[str, Any] = {"mode": "cpuset-shield", "not_enforced": "",
                                         "why": ""}
        self._pids: set[int] = set()
        self._foreign: list[tuple[str, str, str, int]] | None = None  # dir, old, new, tasks
        self._planned = 0.0  # when _foreign was read from the cpuset tree (monotonic)
        self._due: list[tuple[str, str, str, int]] = []  # found by recheck(), not narrowed yet
        self.narrowed: list[tuple[str, str, str]] = []  # dir, old, new: as written
        self.handed = False  # the next holder's region took the narrowed shield over

    def available(self) -> tuple[bool, str]:
        return True, ""  # built only when the shield can act (Shield.ops)

    def undo_records(self) -> list[dict]:
        """Widen the rest cpuset; give other cpusets their cpus back, parents first."""
        records = [{"kind": "cpuset", "path": d, "cpus": old}
                   for d, old, _, _ in reversed(self._plan())]
        if self.shield.path is not None:
            records.insert(0, {"kind": "cpuset", "path": self.shield.path,
                               "cpus": self.shield.all_cpus})
        return records

    def _plan(self) -> list[tuple[str, str, str, int]]:
        """Other cpusets whose tasks may run on the reserved cores, and what they keep."""
        if self._foreign is None:
            managed = set()
            cgroups = getattr(self.holder, "cgroups", None)
            if cgroups is not None and cgroups.cpuset:
                managed.add(os.path.dirname(cgroups.cpuset))  # this daemon's jobs: isolated
            for pid in self._holder_pids():  # never the holder's own cpuset
                rel = _cpuset_of(pid)
                if rel and rel != "/" and self.shield.root:
                    managed.add(os.path.join(self.shield.root, rel.lstrip("/")))
            self._foreign = [
                (d, old, _cpulist([c for c in parse_cpulist(old) if c not in self.cores]), n)
                for d, old, n in self.shield.foreign(self.cores, managed)]
            self._planned = time.monotonic()
        return self._foreign

    def recheck(self) -> bool:
        """A carried narrowing: cpusets made (or widened onto the reserved cores) since it
        was planned, when that was :data:`RECHECK_S` ago or more.  True when some were
        found: they are in the undo records now, and :meth:`after_lease` narrows them once
        the lease that holds those records is with the guardian."""
        if self._foreign is None or time.monotonic() - self._planned < RECHECK_S:
            return False
        carried, self._foreign = self._foreign, None
        fresh = self._plan()
        known = {d for d, _, _, _ in carried}
        self._due = [e for e in fresh if e[0] not in known]
        self._foreign = carried + self._due
        return bool(self._due)

    def after_lease(self) -> None:
        """Narrow what :meth:`recheck` found (their undo records are leased now)."""
        due, self._due = self._due, []
        if due:
            with self.shield.lock:
                self._narrow_foreign(due, key="narrowed_late")

    def _holder_pids(self) -> set[int]:
        if not self._pids:
            self._pids = {r.pid for r in self.holder.processes()}
        return self._pids

    def apply(self) -> None:
        shield = self.shield
        t0 = time.perf_counter()
        with shield.lock:
            shield.establish()
            assert shield.path is not None
            self._holder_pids()
            moved, refused = shield.sweep(self._pids)
            self._holder_out_of_rest()
            parked = shield.take_parked(self.cores)
            if parked is not None:  # still narrowed from the last region: keep it so
                self._take_from(parked, moved, refused)
                shield.end_park_lease()  # this region's lease has the same records
                return
            rest = [c for c in parse_cpulist(shield.all_cpus) if c not in self.cores]
            shield.narrow(rest)
            self._narrow_foreign(self._plan())
        self.evidence.update(cpuset=shield.path, moved=moved, refused=refused[:_LISTED],
                             shielded=len(_procs(shield.path)), cores=self.cores,
                             apply_ms=round((time.perf_counter() - t0) * 1e3, 3))
        self._name_what_stays()

    def _take_from(self, parked: ShieldRegion, moved: int, refused: list[int]) -> None:
        """A lingering narrowing (:meth:`Shield.park`) becomes this region's: no writes
        but the stragglers' moves (and, once its lease has their records, the cpusets
        :meth:`recheck` finds); it widens it at its end (or lets it linger again)."""
        self._foreign, self._planned = parked._foreign, parked._planned
        self.narrowed, parked.narrowed = parked.narrowed, []
        self.evidence = {**parked.evidence, "moved": moved, "refused": refused[:_LISTED],
                         "carried": True, "lingered": True, "late": [], "parked_ms": 0.0,
                         "apply_ms": 0.0, "narrowed_late": [], "unshielded_late": []}
        self.recheck()

    def _holder_out_of_rest(self) -> None:
        """A process moved in while it was unmanaged and since became the holder."""
        shield = self.shield
        assert shield.path is not None and shield.root is not None
        rel = "/" + os.path.relpath(shield.path, shield.root)
        for pid in self._pids:
            if _cpuset_of(pid) == rel:
                with contextlib.suppress(OSError):
                    write(os.path.join(shield.root, "cgroup.procs"), str(pid))

    def _narrow_foreign(self, plan: list[tuple[str, str, str, int]],
                        key: str = "narrowed") -> None:
        """Other cpusets (another daemon's jobs, a container's) lose the reserved cores;
        one left with none, or that refuses, is named in ``unshielded`` (``key``:
        ``narrowed`` at a region's set-up; ``narrowed_late`` for cpusets found by a
        carried narrowing, with ``unshielded_late``)."""
        root = self.shield.root or ""
        narrowed, unshielded = [], []
        for d, old, new, tasks in plan:
            name = {"cpuset": os.path.relpath(d, root), "tasks": tasks}
            if not new:
                unshielded.append({**name, "why": f"has only reserved cores ({old})"})
                continue
            try:
                write(os.path.join(d, "cpuset.cpus"), new)
            except OSError as e:
                unshielded.append({**name, "why": f"{type(e).__name__}: {e}"})
                continue
            self.narrowed.append((d, old, new))
            narrowed.append(name)
        if key == "narrowed":
            self.evidence.update(narrowed=narrowed[:_LISTED], unshielded=unshielded[:_LISTED])
        else:
            self.evidence[key] = (self.evidence.get(key, []) + narrowed)[:_LISTED]
            self.evidence["unshielded_late"] = (self.evidence.get("unshielded_late", [])
                                                + unshielded)[:_LISTED]

    def _name_what_stays(self) -> None:
        shield = self.shield
        assert shield.root is not None
        exempt, kthreads = shield.exempt(self.cores)
        self.evidence.update(exempt=exempt[:_LISTED], kernel_threads_left=kthreads)

    def carriable(self, fresh: ShieldRegion) -> bool:
        return fresh.shield is self.shield and fresh.cores == self.cores and not self.handed

    def hand_over(self, fresh: ShieldRegion, holder_pids: set[int]) -> None:
        """``fresh`` (the next holder's region) keeps the shield narrowed as it is:
        no sweep, no writes; it widens it at its end (or hands it on)."""
        fresh._foreign, fresh.narrowed, self.narrowed = self._foreign, self.narrowed, []
        fresh._planned = self._planned
        fresh.evidence = {**self.evidence, "moved": 0, "refused": [], "carried": True,
                          "apply_ms": 0.0, "narrowed_late": [], "unshielded_late": []}
        fresh._pids = set(holder_pids)  # it is in the slot now: its job cgroup is empty
        self.handed = True

    def _late(self) -> list[int]:
        """What came to the root cpuset during the region (named in the evidence)."""
        shield = self.shield
        late = [p for p in shield.user_tasks(_procs(shield.root or ""))
                if p not in self._pids and p not in shield.devices]
        self.evidence["late"] = late[:_LISTED]
        return late

    def checkpoint(self) -> None:
        """The region ends with the narrowing kept for its holder's next one
        (:mod:`krex.daemon.keep`): what came to the root cpuset meanwhile is named, as at
        :meth:`revert`, and swept off the reserved cores now, as a handoff's is."""
        if self.shield.root is not None and self.shield.path is not None and self._late():
            self.shield.sweep(self._pids)

    def renew(self) -> None:
        """The holder's next region on the kept narrowing: its own evidence from now."""
        self.evidence = {**self.evidence, "moved": 0, "refused": [], "kept": True, "late": [],
                         "apply_ms": 0.0, "narrowed_late": [], "unshielded_late": []}

    def revert(self) -> None:
        shield = self.shield
        if shield.root is None or shield.path is None:
            return
        late = self._late()  # came to the root cpuset during the region
        if self.handed:  # still narrowed: the next region's to widen; what came meanwhile
            if late:     # is swept off its reserved cores now, as its own apply would have
                shield.sweep(self._pids)
            return
        with shield.lock:
            if shield.park(self):  # lingers: the next region may take it over
                self.evidence["parked_ms"] = round(shield.linger_s * 1e3, 3)
                return
            self.widen()

    def widen(self) -> None:
        """The rest cpuset gets every core back, the other cpusets theirs."""
        self.shield.widen()
        for d, old, new in reversed(self.narrowed):  # parents first
            try:  # unless its owner changed it meanwhile: then the owner's value stays
                if parse_cpulist(read(os.path.join(d, "cpuset.cpus"))) == parse_cpulist(new):
                    write(os.path.join(d, "cpuset.cpus"), old)
            except OSError:
                pass
        self.narrowed = []


def evidence(applied: list, shield: Shield | None) -> dict[str, Any] | None:
    """The report's ``shield`` host evidence for a region's applied operations."""
    for op in applied:
        if op.name == "shield":
            return dict(op.evidence)
    return shield.status(acquire=False) if shield is not None else None


# -- undo (the guardian's side) ----------------------------------------------------------


def release(path: str, root: str, timeout_s: float = 2.0) -> list[str]:
    """Every task of the rest cpuset back to the root cpuset, then remove it; tasks
    forked meanwhile are moved on the next pass, until the directory goes (or
    ``timeout_s``; a later daemon's cgroup sweep removes what is left)."""
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    while os.path.isdir(path):
        for pid in _procs(path):
            try:
                write(os.path.join(root, "cgroup.procs"), str(pid))
            except ProcessLookupError:
                pass
            except OSError as e:
                errors.append(f"{RELEASE}: pid {pid}: {e}")
        try:
            os.rmdir(path)
        except FileNotFoundError:
            break
        except OSError as e:
            if time.monotonic() > deadline:
                errors.append(f"{RELEASE}: {path}: {e}")
                break
            time.sleep(0.005)
    return errors[-_LISTED:]


def replay_record(rec: dict) -> list[str]:
    """The guardian's replay of a ``shield_release`` record."""
    try:
        return release(str(rec["path"]), str(rec["root"]))
    except (KeyError, TypeError) as e:
        return [f"{RELEASE}: bad record: {e}"]


__all__ = ["ENV", "MODES", "RELEASE", "SHIELD_LEASE_ID", "Shield", "ShieldRegion",
           "configured_mode", "evidence", "lock_path", "machine_mode", "release",
           "replay_record"]
