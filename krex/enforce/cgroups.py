"""Per-job cgroups: probe the layout, create, join, sweep and remove them.

The layout is probed at run time from ``/proc/self/mounts``: a cgroup2 mount
(``/sys/fs/cgroup`` on pure v2 machines, ``/sys/fs/cgroup/unified`` on hybrid
ones), a v1 ``freezer`` and a v1 ``cpuset`` hierarchy.  krex's tree lives under
the daemon's *own* cgroup in each hierarchy (its systemd unit, Slurm step or
pod; never the hierarchy root unless the daemon is there), so the caller's
limits hold for every job.  Per device, everyone on the device but the region
holder is one subtree (:class:`DeviceCgroups`)::

    <own cgroup>/krex-<instance>/dev-<device>/job-<id>   each job (v2, freezer)
    <own cgroup>/krex-<instance>/dev-<device>            the device's jobs (v1 cpuset)
    <own cgroup>/krex-<instance>/hold-<device>           the holder's slot

Freezing ``dev-<device>`` freezes every job of the device with one write, and
a job created (or a process joining one) while it is frozen is frozen from
birth.  The holder's few processes move to ``hold-<device>`` for its region
and back after (cgroups cannot be renamed across parents).  Instance names
carry the daemon's PID and start time (:func:`instance_name`) so that
:meth:`CgroupLayout.sweep` can tell leftovers of dead daemons from live ones.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass, field

from krex.enforce.process import ProcessRef, may_touch, read_bytes, start_time

_PREFIX = "krex-"


def instance_name(label: str = "d") -> str:
    """``<label><pid>-<start time>``: unique, and checkable for liveness."""
    pid = os.getpid()
    return f"{label}{pid}-{start_time(pid)}"


def _instance_alive(instance: str) -> bool:
    m = re.search(r"(\d+)-(\d+)$", instance)
    if m:
        return start_time(int(m.group(1))) == int(m.group(2))
    first = re.search(r"(\d+)", instance)
    return first is not None and start_time(int(first.group(1))) is not None


def read(path: str) -> str:
    return read_bytes(path).decode().strip()


def write(path: str, value: str) -> None:
    """One ``write(2)`` of ``value``: cgroup files want whole values."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _mounts() -> list[tuple[str, str, set[str]]]:
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                out.append((parts[1], parts[2], set(parts[3].split(","))))
    return out


def favordynmods() -> bool | None:
    """Whether the cgroup2 mount has ``favordynmods`` (None: no cgroup2 mount).  Turned
    off again by a remount it may still be in effect: Linux 6.18 keeps the per-threadgroup
    rwsem it enables until reboot, which :func:`krex.enforce.doctor.move_cost` measures."""
    try:
        v2 = [opts for _, fs, opts in _mounts() if fs == "cgroup2"]
    except OSError:
        return None
    return ("favordynmods" in v2[0]) if v2 else None


_INSTANCE_DIR = re.compile(r"^krex-[a-z]*\d+-\d+$")  # krex-<instance>, krex-shield<pid>-<t>


def _outside_krex(path: str) -> str:
    """``path`` cut at its first ``krex-<instance>`` component: a daemon started by a process that
    sits in a krex tree (a holder adopted by a daemon that then died, a job) puts its own
    tree beside that one, where its sweep finds it -- never nested inside it."""
    parts = path.strip("/").split("/")
    for i, part in enumerate(parts):
        if _INSTANCE_DIR.match(part):
            parts = parts[:i]
            break
    return "/".join(parts)


def _own_v2_dir(root: str) -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return os.path.join(root, _outside_krex(line[3:].strip()))
    return root


def _own_v1_dir(mount: str, controller: str) -> str:
    """This process's cgroup in a v1 hierarchy (the mount point if unknown or gone)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                if controller in names.split(","):
                    own = os.path.join(mount, _outside_krex(path))
                    return own if os.path.isdir(own) else mount
    except (OSError, ValueError):
        pass
    return mount


@dataclass
class DeviceCgroups:
    """One device's subtree: ``parent`` holds every job of the device, ``slot`` the
    region holder (kind -> directory; kinds ``v2``, ``freezer``, ``cpuset``)."""

    device: str
    parent: dict[str, str] = field(default_factory=dict)
    slot: dict[str, str] = field(default_factory=dict)
    mounts: dict[str, str] = field(default_factory=dict)  # kind -> its hierarchy's root


@dataclass
class JobCgroups:
    """The cgroup directories of one job (None where a hierarchy is unusable).

    ``v2`` and ``freezer`` are the job's own directories; ``cpuset`` is the job's
    own one on v2, else (v1) its device's parent, shared by the device's jobs.
    """

    v2: str | None = None
    freezer: str | None = None
    cpuset: str | None = None
    device: DeviceCgroups | None = None
    verified: tuple | None = field(default=None, compare=False)  # anchors seen inside
    # processes adopted from elsewhere -> where they were (kind -> directory)
    origins: dict[ProcessRef, dict[str, str]] = field(default_factory=dict, compare=False)

    def dirs(self) -> list[str]:
        """Every directory to join, the freezing ones last: a process joining a frozen
        job is already in its cpuset when it stops."""
        seen: list[str] = []
        for d in (self.cpuset, self.v2, self.freezer):
            if d and d not in seen:
                seen.append(d)
        return seen

    def own(self) -> list[str]:
        """The job's own directories (removed with the job)."""
        shared = self.device.parent.values() if self.device else ()
        return [d for d in self.dirs() if d not in shared]

    def paths(self) -> dict[str, str | None]:
        """kind -> directory, in joining order (what ``krex run``'s child joins)."""
        return {"cpuset": self.cpuset, "v2": self.v2, "freezer": self.freezer}

    def join_self(self) -> None:
        """Move the calling process into every directory (for ``preexec_fn``).

        Only ``os.open``/``os.write``: safe between fork and exec.
        """
        for d in self.dirs():
            fd = os.open(d + "/cgroup.procs", os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

    def adopt(self, ref: ProcessRef) -> bool:
        """Move a running process in (after a PID-reuse check)."""
        if not ref.alive() or not may_touch(ref.pid):
            return False
        if self.device is not None:
            self.origins[ref] = _origin(ref.pid, self.paths(), self.device.mounts)
        try:
            for d in self.dirs():
                write(d + "/cgroup.procs", str(ref.pid))
        except (ProcessLookupError, OSError):
            return False
        return True

    def pids(self) -> list[int]:
        """Members (every hierarchy holds the same ones: join and adopt write all)."""
        dirs = self.own()
        return sorted(_procs(dirs[0])) if dirs else []

    def kill_all(self, rounds: int = 50) -> int:
        """SIGKILL every member, again until none is left (a fork meanwhile joins the
        cgroup): what the job started goes too, a double fork that left its parent's
        process tree included.  The number of signals sent."""
        sent = 0
        for _ in range(rounds):
            members = [pid for pid in self.pids() if may_touch(pid)]
            if not members:
                break
            for pid in members:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    sent += 1
            time.sleep(0.005)
        return sent

    def remove(self) -> None:
        self._leave_slot_cpuset()
        self.put_back()
        for d in self.own():
            _remove_dir(d)

    def _leave_slot_cpuset(self) -> None:
        """Processes of this job in its device's slot cpuset (v1; staged there, frozen,
        by :meth:`krex.enforce.enforcer.Enforcement.prefetch`) go back to the device's
        cpuset before the job's cgroups are thawed and removed: an ended job's
        processes never run on the reserved cores."""
        dev = self.device
        slot = dev.slot.get("cpuset") if dev is not None else None
        if not slot or not self.cpuset or self.cpuset == slot or self.cpuset == self.v2:
            return
        mine = set(self.pids())
        for pid in _procs(slot):
            if pid in mine:
                try:
                    write(self.cpuset + "/cgroup.procs", str(pid))
                except OSError:
                    pass

    def put_back(self) -> None:
        """Adopted processes still in the job go back to the cgroups they came from
        (their unit's, their step's: with its limits), not to krex's parent."""
        for ref, origin in self.origins.items():
            if not ref.alive():
                continue
            for kind, d in self.paths().items():
                back = origin.get(kind)
                if d and back and os.path.isdir(back) and ref.pid in _procs(d):
                    try:
                        write(back + "/cgroup.procs", str(ref.pid))
                    except OSError:
                        pass
        self.origins.clear()


def _origin(pid: int, paths: dict[str, str | None], mounts: dict[str, str]) -> dict[str, str]:
    """The cgroup directory ``pid`` is in now, for each kind krex moves it in."""
    out: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return out
    for kind in (k for k, d in paths.items() if d and k in mounts):
        for n, names, rel in lines:
            v2_line = n == "0" and names == ""
            if (kind == "v2" and v2_line) or (kind != "v2" and kind in names.split(",")) or \
                    (kind == "cpuset" and v2_line and mounts[kind] == mounts.get("v2")):
                out[kind] = os.path.join(mounts[kind], rel.lstrip("/"))
                break
    return out


def move_all(src: str, dst: str, rounds: int = 4, known: list[int] | None = None) -> list[int]:
    """Move every process of ``src`` into ``dst`` (again while forks keep adding); the
    PIDs moved.  O(processes of ``src``).  ``known``: ``src``'s members as just read,
    taken for the first round's read (only where none can have joined since)."""
    moved: list[int] = []
    for i in range(rounds):
        pids = known if i == 0 and known is not None else _procs(src)
        if not pids:
            break
        for pid in pids:
            try:
                write(dst + "/cgroup.procs", str(pid))
                moved.append(pid)
            except (ProcessLookupError, OSError):
                pass
    return moved


def _procs(d: str) -> list[int]:
    try:
        return [int(x) for x in read(d + "/cgroup.procs").split()]
    except (FileNotFoundError, OSError):
        return []


def _hierarchy_root(d: str) -> str:
    """The cgroup above ``.../krex-<instance>/...``: the daemon's own (its caller's)."""
    while os.path.basename(d) and not os.path.basename(d).startswith(_PREFIX):
        d = os.path.dirname(d)
    return os.path.dirname(d)


def _remove_dir(d: str) -> None:
    """Thaw, move any remaining processes up to the cgroup krex's tree is in, rmdir."""
    if not os.path.isdir(d):
        return
    _thaw_dir(d)
    root = _hierarchy_root(d)
    for pid in _procs(d):
        try:
            write(root + "/cgroup.procs", str(pid))
        except OSError:
            pass
    try:
        os.rmdir(d)
    except OSError:
        pass


def _thaw_dir(d: str) -> None:
    for name, value in (("cgroup.freeze", "0"), ("freezer.state", "THAWED")):
        if os.path.exists(os.path.join(d, name)):
            try:
                write(os.path.join(d, name), value)
            except OSError:
                pass


@dataclass
class CgroupLayout:
    """Where krex may create job cgroups on this machine, and why not elsewhere."""

    v2_root: str | None = None
    v2_base: str | None = None
    freezer: str | None = None
    cpuset: str | None = None
    v2_writable: bool = False
    freezer_writable: bool = False
    cpuset_writable: bool = False
    v2_cpuset: bool = False
    reasons: dict[str, str] = field(default_factory=dict)
    mounts: dict[str, str] = field(default_factory=dict)  # kind -> hierarchy root

    @classmethod
    def probe(cls) -> CgroupLayout:
        layout = cls()
        try:
            mounts = _mounts()
        except OSError as e:
            layout.reasons["cgroups"] = f"cannot read /proc/self/mounts: {e}"
            return layout
        layout._probe_v2(mounts)
        layout._probe_v1(mounts, "freezer")
        layout._probe_v1(mounts, "cpuset")
        return layout

    @classmethod
    def none(cls, why: str = "cgroups disabled") -> CgroupLayout:
        return cls(reasons={"v2": why, "freezer": why, "cpuset": why})

    def _probe_v2(self, mounts: list[tuple[str, str, set[str]]]) -> None:
        roots = [m[0] for m in mounts if m[1] == "cgroup2"]
        if not roots:
            self.reasons["v2"] = "no cgroup2 mount"
            return
        root = "/sys/fs/cgroup" if "/sys/fs/cgroup" in roots else roots[0]
        self.v2_root = root
        self.mounts["v2"] = root
        for base in dict.fromkeys((_own_v2_dir(root), root)):  # the caller's own first
            if os.access(base + "/cgroup.procs", os.W_OK) and _probe_freeze(base):
                self.v2_base, self.v2_writable = base, True
                break
        else:
            self.reasons["v2"] = f"{root}: no writable cgroup with cgroup.freeze (need root)"
            return
        self.v2_cpuset = "cpuset" in _controllers(self.v2_base)

    def _probe_v1(self, mounts: list[tuple[str, str, set[str]]], name: str) -> None:
        paths = [m[0] for m in mounts if m[1] == "cgroup" and name in m[2]]
        if not paths:
            self.reasons[name] = f"no cgroup v1 {name} hierarchy mounted"
            return
        base = _own_v1_dir(paths[0], name)
        self.mounts[name] = paths[0]
        setattr(self, name, base)
        ok = os.access(base, os.W_OK) and os.access(base + "/cgroup.procs", os.W_OK)
        setattr(self, f"{name}_writable", ok)
        if not ok:
            self.reasons[name] = f"{base} not writable (need root)"

    def bases(self) -> dict[str, str]:
        """Usable hierarchy -> the directory krex-<instance> dirs go in."""
        out = {}
        if self.v2_writable and self.v2_base:
            out["v2"] = self.v2_base
        if self.freezer_writable and self.freezer:
            out["freezer"] = self.freezer
        if self.cpuset_writable and self.cpuset:
            out["cpuset"] = self.cpuset
        return out

    def device(self, instance: str, device: str = "cpu") -> DeviceCgroups:
        """The device's subtree (``dev-`` parent and ``hold-`` slot), made on first use."""
        dev = DeviceCgroups(device, mounts=dict(self.mounts))
        name = _dir_name(device)
        for kind, base in self.bases().items():
            inst = os.path.join(base, _PREFIX + instance)
            parent, slot = os.path.join(inst, "dev-" + name), os.path.join(inst, "hold-" + name)
            try:
                _make(base, inst, kind)
                _make(inst, parent, kind)
                _make(inst, slot, kind)
            except OSError as e:
                self.reasons[f"{kind}-create"] = f"{parent}: {e}"
                continue
            dev.parent[kind], dev.slot[kind] = parent, slot
        if "v2" in dev.parent and self.v2_cpuset and "cpuset" not in dev.parent \
                and os.path.exists(dev.slot["v2"] + "/cpuset.cpus"):
            dev.parent["cpuset"], dev.slot["cpuset"] = dev.parent["v2"], dev.slot["v2"]
            dev.mounts["cpuset"] = dev.mounts["v2"]
        return dev

    def create_job(self, instance: str, job_id: int, device: str = "cpu") -> JobCgroups:
        dev = self.device(instance, device)
        job = JobCgroups(device=dev)
        for kind, parent in dev.parent.items():
            if kind == "cpuset" and parent != dev.parent.get("v2"):
                job.cpuset = parent  # v1: a cpuset per device, not per job
                continue
            path = os.path.join(parent, f"job-{job_id}")
            try:
                _make(parent, path, kind)
            except OSError as e:
                self.reasons[f"{kind}-create"] = f"{path}: {e}"
                continue
            setattr(job, kind, path)
        if job.v2 and "cpuset" in dev.parent and not job.cpuset:
            job.cpuset = job.v2
        return job

    def remove_instance(self, instance: str) -> None:
        for base in self.bases().values():
            _remove_tree(os.path.join(base, _PREFIX + instance))

    def sweep(self) -> list[str]:
        """Thaw and remove every krex-<instance> tree whose daemon is dead."""
        removed = []
        for base in self.bases().values():
            for name in _listdir(base):
                if name.startswith(_PREFIX) and not _instance_alive(name[len(_PREFIX) :]):
                    _remove_tree(os.path.join(base, name))
                    removed.append(os.path.join(base, name))
        return removed


def _dir_name(device: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", device)


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def _controllers(d: str) -> list[str]:
    try:
        return read(d + "/cgroup.controllers").split()
    except OSError:
        return []


def _probe_freeze(base: str) -> bool:
    """cgroup.freeze exists in non-root cgroups only: look at (or make) one."""
    probe = os.path.join(base, f"{_PREFIX}probe-{os.getpid()}")
    try:
        os.mkdir(probe)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        return os.path.exists(probe + "/cgroup.freeze")
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


def _make(parent: str, path: str, kind: str) -> None:
    if not os.path.isdir(path):
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
    if kind == "cpuset":
        _no_domain_rebuild(path)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if not read(os.path.join(path, name)):
                write(os.path.join(path, name), read(os.path.join(parent, name)))
    elif kind == "v2" and "cpuset" in _controllers(parent):
        try:
            write(parent + "/cgroup.subtree_control", "+cpuset")
        except OSError:
            pass


def _no_domain_rebuild(path: str) -> None:
    """Changing cpuset.cpus of a load-balanced cpuset rebuilds the scheduler
    domains (milliseconds); krex cpusets leave balancing to the root's."""
    try:
        write(os.path.join(path, "cpuset.sched_load_balance"), "0")
    except OSError:
        pass


def _remove_tree(top: str) -> None:
    """Children first (jobs under their device), each thawed and emptied, then ``top``."""
    _thaw_dir(top)
    for name in _listdir(top):
        if os.path.isdir(os.path.join(top, name)):
            _remove_tree(os.path.join(top, name))
    _remove_dir(top)
