"""Freeze sibling jobs so their host threads stop competing with the holder.

Three backends, best first: :class:`CgroupV2Freeze` (``cgroup.freeze``, wait
for ``frozen 1`` in ``cgroup.events``), :class:`CgroupV1Freeze`
(``freezer.state``), :class:`SignalFreeze` (SIGSTOP every process, wait until
each thread is in state T).  The cgroup backends freeze each job's cgroup and
SIGSTOP any process of the job that is outside it (an ad-hoc job, a job
started before its cgroup existed).

A freeze that does not complete within ``timeout_s`` does not raise: the op
keeps what it stopped (undone on revert) and says why in ``incomplete``; the
enforcer records the step as timed out and the region is not clean
(``step_timeout``).  Errors still raise.

SIGSTOP caveat: a process group that becomes orphaned while a member is
stopped gets SIGHUP from the kernel.  The daemon starts every job in a new
session (``start_new_session=True``); such groups are never "orphaned by the
daemon's exit" in the kernel's sense, so a daemon crash cannot SIGHUP them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from krex.enforce.cgroups import read, write
from krex.enforce.job import JobTarget, processes_of
from krex.enforce.process import ProcessRef, state, thread_ids
from krex.errors import EnforcementFailed

_STOPPED = ("T", "t")
_GONE = ("Z", "X", None)


def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``done`` with a backoff from 20 µs to 2 ms; False on timeout."""
    deadline = time.monotonic() + timeout_s
    pause = 20e-6
    while not done():
        if time.monotonic() > deadline:
            return done()
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    return True


def _fully_stopped(ref: ProcessRef) -> bool:
    if ref.state() in _GONE:
        return True
    return all(state(ref.pid, tid) in _STOPPED + _GONE for tid in thread_ids(ref.pid))


def _describe(ref: ProcessRef) -> str:
    """PID, command and thread states, for an error a person can act on."""
    try:
        with open(f"/proc/{ref.pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        comm = "?"
    states = "".join(sorted(state(ref.pid, t) or "?" for t in thread_ids(ref.pid)))
    try:
        with open(f"/proc/{ref.pid}/cgroup") as f:
            groups = ",".join(x.split(":", 2)[2].strip() for x in f if "krex" in x)
    except OSError:
        groups = ""
    return f"{ref.pid} ({comm}, thread states {states}, cgroups {groups or '-'})"


class SignalFreeze:
    """SIGSTOP every process of every target; SIGCONT exactly those on revert."""

    name = "freeze"
    keepable = True  # may stay applied for the holder's next region (krex.daemon.keep)
    backend = "signal"

    def __init__(
        self,
        targets: list[JobTarget],
        *,
        timeout_s: float = 2.0,
        exclude: set[int] | None = None,
        covered: Callable[[], set[int]] | None = None,
    ) -> None:
        self.targets = targets
        self.timeout_s = timeout_s
        self.exclude = exclude or set()
        self.covered = covered or set  # PIDs another mechanism already froze
        self.stopped: list[ProcessRef] = []
        self._planned: list[ProcessRef] | None = None
        self.incomplete: str | None = None  # set when a process did not stop in time

    def available(self) -> tuple[bool, str]:
        return True, ""

    def _candidates(self) -> list[ProcessRef]:
        skip = self.exclude | self.covered()
        done = {r.pid for r in self.stopped}
        refs = [r for refs in processes_of(self.targets) for r in refs]
        return [r for r in refs if r.pid not in skip and r.pid not in done]

    def _plan(self) -> list[ProcessRef]:
        if self._planned is None:
            # A process stopped before we came (a user's ^Z) stays stopped.
            self._planned = [r for r in self._candidates() if r.state() not in _STOPPED]
        return self._planned

    def undo_records(self) -> list[dict]:
        refs = {r.pid: r for r in self._plan() + self.stopped}
        return [
            {"kind": "sigcont", "pid": r.pid, "start_time": r.start_time} for r in refs.values()
        ]

    def apply(self) -> None:
        batch = self._plan()
        for _round in range(8):  # children forked while we stop their parents
            self._stop(batch)
            if self.incomplete:
                return
            batch = [r for r in self._candidates() if r.state() not in _STOPPED]
            if not batch:
                return
        raise EnforcementFailed("processes kept appearing while freezing (fork storm?)")

    def _stop(self, refs: list[ProcessRef]) -> None:
        # The plan may predate a cgroup freeze (it is made for the guardian's lease
        # first): a process that has since joined a frozen cgroup is frozen already,
        # and a SIGSTOP to it would stay pending until the thaw.
        covered = self.covered()
        sent = [r for r in refs if r.pid not in covered and r.send_signal(signal.SIGSTOP)]
        self.stopped.extend(sent)
        if not wait_until(lambda: all(_fully_stopped(r) for r in sent), self.timeout_s):
            # Not an abort: the region runs, the stopped stay stopped until revert, and
            # the report says so (step_timeout).
            slow = [_describe(r) for r in sent if not _fully_stopped(r)]
            self.incomplete = f"processes {slow} did not stop within {self.timeout_s} s"

    def revert(self) -> None:
        for ref in self.stopped:
            ref.send_signal(signal.SIGCONT)
        self.stopped = []

    def frozen_count(self) -> int:
        return len(self.stopped)


def _cgroup_dir(target: JobTarget, attr: str) -> str | None:
    return getattr(target.cgroups, attr, None) if target.cgroups else None


class _CgroupFreeze:
    """Common part of the cgroup freezers: write, wait, thaw, straggler SIGSTOP."""

    name = "freeze"
    keepable = True  # may stay applied for the holder's next region (krex.daemon.keep)
    backend = ""
    attr = ""  # JobCgroups attribute holding this hierarchy's directory
    control = ""  # the file that freezes the cgroup
    freeze_value, thaw_value, undo_kind = "", "", ""

    def __init__(
        self, targets: list[JobTarget], *, timeout_s: float = 2.0, exclude: set[int] | None = None
    ) -> None:
        self.targets = targets
        self.timeout_s = timeout_s
        self.dirs = [d for t in targets if (d := _cgroup_dir(t, self.attr))]
        self.frozen: list[str] = []
        self._slow: str | None = None
        self.stragglers = SignalFreeze(
            [], timeout_s=timeout_s, exclude=exclude, covered=self._covered
        )
        self._split = False

    def _split_stragglers(self) -> None:
        """Jobs wholly inside their cgroup need no signals; the rest get SIGSTOP."""
        if not self._split:
            self.stragglers.targets = [t for t in self.targets if self._needs_signals(t)]
            self._split = True

    def _needs_signals(self, target: JobTarget) -> bool:
        return _cgroup_dir(target, self.attr) is None or target.cgroup_only() is None

    def _covered(self) -> set[int]:
        pids: set[int] = set()
        for d in self.dirs:
            try:
                pids.update(int(x) for x in read(d + "/cgroup.procs").split())
            except OSError:
                pass
        return pids

    def available(self) -> tuple[bool, str]:
        missing = [d for d in self.dirs if not os.path.exists(os.path.join(d, self.control))]
        if missing:
            return False, f"no {self.control} in {missing[0]}"
        return True, ""

    def undo_records(self) -> list[dict]:
        self._split_stragglers()
        thaw = [{"kind": self.undo_kind, "path": d} for d in self.dirs]
        return thaw + self.stragglers.undo_records()

    def apply(self) -> None:
        self._split_stragglers()
        for d in self.dirs:
            write(os.path.join(d, self.control), self.freeze_value)
            self.frozen.append(d)
        if not wait_until(lambda: all(self._is_frozen(d) for d in self.dirs), self.timeout_s):
            slow = [d for d in self.dirs if not self._is_frozen(d)]
            self._slow = f"cgroups {slow} did not freeze within {self.timeout_s} s"
        self.stragglers.apply()

    @property
    def incomplete(self) -> str | None:
        """Why the freeze is incomplete (timed out), or None."""
        parts = [p for p in (self._slow, self.stragglers.incomplete) if p]
        return "; ".join(parts) or None

    def revert(self) -> None:
        thawed = _thawed_meanwhile(self.frozen, self.control, self.thaw_value)
        if thawed and not self._slow:
            self._slow = thawed
        self.stragglers.revert()
        for d in self.frozen:
            try:
                write(os.path.join(d, self.control), self.thaw_value)
            except FileNotFoundError:
                pass
        self.frozen = []

    def _is_frozen(self, d: str) -> bool:
        raise NotImplementedError

    def frozen_count(self) -> int:
        return len(self._covered()) + self.stragglers.frozen_count()

    @property
    def full_backend(self) -> str:
        return self.backend + ("+signal" if self.stragglers.stopped else "")


class CgroupV2Freeze(_CgroupFreeze):
    backend = "cgroup2"
    attr = "v2"
    control = "cgroup.freeze"
    freeze_value, thaw_value, undo_kind = "1", "0", "thaw_v2"

    def _is_frozen(self, d: str) -> bool:
        return _v2_frozen(d)


class CgroupV1Freeze(_CgroupFreeze):
    backend = "cgroup1"
    attr = "freezer"
    control = "freezer.state"
    freeze_value, thaw_value, undo_kind = "FROZEN", "THAWED", "thaw_v1"

    def _is_frozen(self, d: str) -> bool:
        return _v1_frozen(d)


def _v2_frozen(d: str) -> bool:
    return "frozen 1" in read(d + "/cgroup.events")


def _v1_frozen(d: str) -> bool:
    return read(d + "/freezer.state") == "FROZEN"  # FREEZING until every descendant is


def _thawed_meanwhile(dirs: list[str], control: str, thaw_value: str) -> str | None:
    """At a region's end: which of the cgroups it froze read "thawed" (someone wrote
    the control meanwhile: another root process, the guardian on a lease's expiry).
    Checked whatever the grant saw, since a freeze seen complete can be undone later."""
    thawed = []
    for d in dirs:
        try:
            if read(os.path.join(d, control)) == thaw_value:
                thawed.append(d)
        except FileNotFoundError:
            pass  # removed under the region (its job ended): nothing of it runs
    return f"cgroups {thawed} were thawed before the region ended" if thawed else None


class SubtreeFreeze:
    """Freeze whole device subtrees, one write each, whatever the number of siblings.

    ``parents`` are the device parents (``dev-<device>``) of one hierarchy
    (``kind``: ``v2`` or ``freezer``); every job of those devices is frozen with
    them, and so is any job created or process joining one until the thaw (a
    cgroup made under a frozen parent is frozen from birth).  The holder is not
    among them: :class:`~krex.enforce.slot.HolderSlot` moved it out first.
    Sibling jobs with processes outside their cgroup (``stragglers``) are also
    SIGSTOPped, exactly their own processes.
    """

    name = "freeze"
    keepable = True  # may stay applied for the holder's next region (krex.daemon.keep)
    count_at_exit = True  # processes frozen are counted for the report, off the grant path

    def __init__(self, kind: str, parents: list[str], siblings: list[JobTarget], *,
                 timeout_s: float = 2.0, exclude: set[int] | None = None) -> None:
        cls = CgroupV2Freeze if kind == "v2" else CgroupV1Freeze
        self.kind, self.cls = kind, cls
        self.backend = cls.backend
        self.parents = list(dict.fromkeys(parents))
        self.siblings = siblings
        self.timeout_s = timeout_s
        loose = [t for t in siblings if t.may_run_outside()]
        self.stragglers = SignalFreeze(loose, timeout_s=timeout_s, exclude=exclude,
                                       covered=lambda: _pids_in(loose, kind))
        self.frozen: list[str] = []
        self._slow: str | None = None
        self._confirmed = False
        self._applied_at = 0.0
        self.handed: set[int] = set()  # siblings' processes that left for the slot at a handoff
        # the subtrees it handed over (still frozen for the next holder) and when: their
        # freeze is this region's too, confirmed at its end (:meth:`_confirm`)
        self._handed_parents: list[str] = []
        self._handed_at = 0.0

    def available(self) -> tuple[bool, str]:
        missing = [d for d in self.parents if not os.path.exists(os.path.join(d, self.cls.control))]
        if missing or not self.parents:
            return False, f"no {self.cls.control} in {missing[0] if missing else 'any parent'}"
        return True, ""

    def undo_records(self) -> list[dict]:
        thaw = [{"kind": self.cls.undo_kind, "path": d} for d in self.parents]
        return thaw + self.stragglers.undo_records()

    def apply(self) -> None:
        for d in self.parents:
            write(os.path.join(d, self.cls.control), self.cls.freeze_value)
            self.frozen.append(d)
        self._applied_at = time.monotonic()
        # Once the write returns, no task of the subtree runs another user instruction:
        # one on a CPU is kicked into the freezer trap (an IPI, microseconds), one that
        # waits for a CPU takes the trap on its way back to user space.  What remains
        # until the kernel reports "frozen" is those tasks reaching the trap (they need
        # a CPU for that, which the grant would otherwise spend waiting), so the grant
        # looks once; the rest is confirmed when the region ends.
        self._confirmed = self._all_frozen()
        if self.stragglers.targets:
            self.stragglers.apply()

    def _all_frozen(self) -> bool:
        is_frozen = _v2_frozen if self.kind == "v2" else _v1_frozen
        return all(is_frozen(d) for d in self.parents)

    def _confirm(self) -> None:
        """At the region's end: the subtree must have reached "frozen" within the timeout
        (a task stuck on its way, e.g. in uninterruptible sleep, makes the step timed out).

        A region that handed its subtrees over (still frozen for the next holder) is
        confirmed the same way, after that grant: its outgoing holder has joined them
        since, which can only delay "frozen" (the timeout counts from the handoff), never
        fake it.  Either way, a subtree thawed meanwhile is named, even one the grant
        already saw "frozen"."""
        held = self.frozen or self._handed_parents
        if not held:
            return
        # read even when the grant saw "frozen": a freeze seen complete can be undone
        self._slow = _thawed_meanwhile(held, self.cls.control, self.cls.thaw_value)
        if self._slow or self._confirmed:
            return
        since = self._applied_at if self.frozen else self._handed_at
        left = self.timeout_s - (time.monotonic() - since)
        self._confirmed = wait_until(self._all_frozen, max(0.0, left))
        if not self._confirmed:
            is_frozen = _v2_frozen if self.kind == "v2" else _v1_frozen
            slow = [d for d in self.parents if not is_frozen(d)]
            self._slow = f"cgroups {slow} did not freeze within {self.timeout_s} s"

    @property
    def incomplete(self) -> str | None:
        parts = [p for p in (self._slow, self.stragglers.incomplete) if p]
        return "; ".join(parts) or None

    def revert(self) -> None:
        self._confirm()
        self.stragglers.revert()
        for d in self.frozen:
            try:
                write(os.path.join(d, self.cls.control), self.cls.thaw_value)
            except FileNotFoundError:
                pass
        self.frozen = []

    def frozen_count(self) -> int:
        pids = _pids_in(self.siblings, self.kind) | self.handed
        return len(pids) + self.stragglers.frozen_count()

    # -- overlapped handoff (krex.enforce.handoff) -------------------------------------

    def carriable(self) -> bool:
        """Whether this freeze can stay applied for another holder: one write per
        parent and nothing else (no sibling process SIGSTOPped outside its cgroup)."""
        return bool(self.frozen) and not self.stragglers.targets and not self.stragglers.stopped

    def hand_over(self, fresh: SubtreeFreeze, incoming: set[int]) -> None:
        """``fresh`` (the next region's freeze of the same parents) takes the frozen
        subtrees over without a write; this region stops being the one to thaw them.
        ``incoming``: the next holder's processes, frozen by this region and now in
        the slot, still counted as frozen in this region's report.  A subtree not yet
        seen "frozen" is confirmed when this region's report is made, after the grant."""
        fresh.frozen = list(self.frozen)
        fresh._applied_at = time.monotonic()
        self._handed_parents, self._handed_at = self.frozen, fresh._applied_at
        self.frozen = []
        self.handed = set(incoming)

    @property
    def full_backend(self) -> str:
        return self.backend + ("+signal" if self.stragglers.stopped else "")


def _pids_in(targets: list[JobTarget], kind: str) -> set[int]:
    pids: set[int] = set()
    for t in targets:
        d = _cgroup_dir(t, kind)
        if d:
            try:
                pids.update(int(x) for x in read(d + "/cgroup.procs").split())
            except OSError:
                pass
    return pids


FREEZERS = {"cgroup2": CgroupV2Freeze, "cgroup1": CgroupV1Freeze, "signal": SignalFreeze}
