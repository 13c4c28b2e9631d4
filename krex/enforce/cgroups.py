"""Per-job cgroups: probe the layout, create, join, sweep and remove them.

The layout is probed at run time from ``/proc/self/mounts``: a cgroup2 mount
(``/sys/fs/cgroup`` on pure v2 machines, ``/sys/fs/cgroup/unified`` on hybrid
ones), a v1 ``freezer`` and a v1 ``cpuset`` hierarchy.  Each job gets
``<hierarchy>/krex-<instance>/job-<id>`` in every usable hierarchy.  Instance
names carry the daemon's PID and start time (:func:`instance_name`) so that
:meth:`CgroupLayout.sweep` can tell leftovers of dead daemons from live ones.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from krex.enforce.process import ProcessRef, may_touch, start_time

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
    with open(path) as f:
        return f.read().strip()


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


def _own_v2_dir(root: str) -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return os.path.join(root, line[3:].strip().lstrip("/"))
    return root


@dataclass
class JobCgroups:
    """The cgroup directories of one job (None where a hierarchy is unusable)."""

    v2: str | None = None
    freezer: str | None = None
    cpuset: str | None = None

    def dirs(self) -> list[str]:
        seen: list[str] = []
        for d in (self.v2, self.freezer, self.cpuset):
            if d and d not in seen:
                seen.append(d)
        return seen

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
        try:
            for d in self.dirs():
                write(d + "/cgroup.procs", str(ref.pid))
        except (ProcessLookupError, OSError):
            return False
        return True

    def pids(self) -> list[int]:
        """Members (every hierarchy holds the same ones: join and adopt write all)."""
        dirs = self.dirs()
        return sorted(_procs(dirs[0])) if dirs else []

    def remove(self) -> None:
        for d in self.dirs():
            _remove_dir(d)


def _procs(d: str) -> list[int]:
    try:
        return [int(x) for x in read(d + "/cgroup.procs").split()]
    except (FileNotFoundError, OSError):
        return []


def _hierarchy_root(d: str) -> str:
    """The mount point above ``.../krex-<instance>/job-<id>``."""
    while os.path.basename(d) and not os.path.basename(d).startswith(_PREFIX):
        d = os.path.dirname(d)
    return os.path.dirname(d)


def _remove_dir(d: str) -> None:
    """Thaw, move any remaining processes up to the hierarchy root, rmdir."""
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
        for base in (root, _own_v2_dir(root)):
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
        setattr(self, name, paths[0])
        ok = os.access(paths[0], os.W_OK) and os.access(paths[0] + "/cgroup.procs", os.W_OK)
        setattr(self, f"{name}_writable", ok)
        if not ok:
            self.reasons[name] = f"{paths[0]} not writable (need root)"

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

    def create_job(self, instance: str, job_id: int) -> JobCgroups:
        job = JobCgroups()
        for kind, base in self.bases().items():
            inst = os.path.join(base, _PREFIX + instance)
            path = os.path.join(inst, f"job-{job_id}")
            try:
                _make(base, inst, kind)
                _make(inst, path, kind)
            except OSError as e:
                self.reasons[f"{kind}-create"] = f"{path}: {e}"
                continue
            setattr(job, kind, path)
        if job.v2 and self.v2_cpuset and not job.cpuset:
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


def _remove_tree(inst: str) -> None:
    for name in _listdir(inst):
        if os.path.isdir(os.path.join(inst, name)):
            _remove_dir(os.path.join(inst, name))
    _remove_dir(inst)
