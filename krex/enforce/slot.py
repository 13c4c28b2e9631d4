"""The holder's slot: the region holder leaves its device's subtree for its region.

Every job of a device lives under the device's parent cgroup, which the
freeze step freezes with one write (:class:`~krex.enforce.freeze.SubtreeFreeze`).
The holder must not be frozen with them, and cgroups cannot be renamed across
parents, so :class:`HolderSlot` moves the holder's processes (a few, whatever
the number of siblings) from its job cgroup to the device's ``hold-`` slot
before the freeze, and back after the thaw.  Processes the holder forks during
the region are born in the slot and go back with it.  In the v1 cpuset
hierarchy the slot is also the holder's reserved-core partition, so this move
is the holder's half of CPU isolation.

Undo after a crash needs nothing of its own: a process left in the slot is
thawed and, by the isolation step's undo record, given every core back; the
next daemon's sweep moves it out of the dead instance's tree.
"""

from __future__ import annotations

from collections.abc import Collection

from krex.enforce.cgroups import DeviceCgroups, _procs, move_all, write
from krex.enforce.job import JobTarget


class HolderSlot:
    """Move ``holder``'s processes into its device's slot; back on revert."""

    name = "slot"
    keepable = True  # may stay applied for the holder's next region (krex.daemon.keep)
    backend = "cgroup"

    def __init__(self, holder: JobTarget) -> None:
        self.holder = holder
        cg = holder.cgroups
        self.device: DeviceCgroups | None = cg.device if cg is not None else None
        # kind -> (the job's directory in that hierarchy, the slot's)
        self.moves: dict[str, tuple[str, str]] = {}
        if cg is not None and self.device is not None:
            for kind, src in (("v2", cg.v2), ("freezer", cg.freezer), ("cpuset", cg.cpuset)):
                dst = self.device.slot.get(kind)
                if src and dst and not (kind == "cpuset" and src == cg.v2):
                    self.moves[kind] = (src, dst)
        self.moved: list[int] = []
        self.applied = False
        self._back: list[int] | None = None  # moved back by revert_lead, the rest to follow

    def available(self) -> tuple[bool, str]:
        if not self.moves:
            return False, "the holder has no cgroup under a device subtree"
        return True, ""

    def undo_records(self) -> list[dict]:
        return []  # see the module docstring

    def apply(self, source_frozen: bool = False,
              members: tuple[str, list[int]] | None = None,
              staged: Collection[int] = ()) -> None:
        """``source_frozen``: the job cgroup is under a frozen parent (a handoff), so no
        process of it can fork meanwhile and one read of its members finds them all;
        ``members``: (directory, PIDs), that read made already by the handoff (taken
        when it is of the directory moved from); ``staged``: PIDs already in the slot's
        v1 cpuset (:meth:`stage`)."""
        self.applied = True
        lead = next((k for k in ("v2", "freezer") if k in self.moves), None)
        if lead is not None and source_frozen:
            # Frozen, its processes can neither fork nor leave: they go to the other
            # hierarchies (the reserved cores' cpuset) first, and the freezing one's move
            # last thaws them there.  Thawed first, they woke on the unreserved cores,
            # where the daemon's thread making this move runs, and often took its core
            # until the cpuset move (the grant's push waited ≈ 0.3 ms behind them).
            src, dst = self.moves[lead]
            known = members[1] if members and members[0] == src else _procs(src)
            self._follow_all(lead, [pid for pid in known if pid not in staged])
            self.moved = move_all(src, dst, rounds=1, known=known)
            return
        if lead is not None:
            self.moved = move_all(*self.moves[lead])
        else:  # only the cpuset moves, and a v1 one is shared: the job's PIDs, no more
            assert self.holder.cgroups is not None
            self.moved = self.holder.cgroups.pids()
        self._follow_all(lead, self.moved)

    def _follow_all(self, lead: str | None, pids: list[int]) -> None:
        for kind, (_, dst) in self.moves.items():
            if kind != lead:
                self._follow(dst, pids)

    def _follow(self, dst: str, pids: list[int]) -> list[int]:
        """The other hierarchies: the same processes (v1 cpuset dirs are shared by the
        device's jobs, so move exactly the holder's PIDs, not the directory); the PIDs
        moved."""
        moved = []
        for pid in pids:
            try:
                write(dst + "/cgroup.procs", str(pid))
                moved.append(pid)
            except (ProcessLookupError, OSError):
                pass
        return moved

    def revert(self) -> None:
        if not self.applied:
            return
        if self._back is not None:  # the freezing hierarchy went back at a handoff
            self.revert_rest()
            return
        for src, dst in self.moves.values():
            move_all(dst, src)  # the slot holds only the holder's processes
        self.applied = False

    # -- overlapped handoff (krex.enforce.handoff) ---------------------------------------

    def _lead(self) -> str | None:
        return next((k for k in ("v2", "freezer") if k in self.moves), None)

    def revert_lead(self) -> None:
        """Back into the job cgroup of the freezing hierarchy only: under the frozen
        device parent the processes stop at once.  The next holder can be let in; the
        other hierarchies (the v1 cpuset) follow, after its grant, in :meth:`revert_rest`."""
        lead = self._lead()
        if not self.applied or lead is None:
            return
        src, dst = self.moves[lead]
        self._back = move_all(dst, src)

    def keep_staged(self) -> list[int]:
        """After :meth:`revert_lead`: the processes moved back stay in the slot's v1
        cpuset, staged (frozen) for a handoff back to them, instead of following into
        their device's cpuset now; the PIDs (none without a v1 cpuset move)."""
        if "cpuset" not in self.moves or self._back is None:
            return []
        kept, self._back = self._back, []
        return kept

    def revert_rest(self) -> None:
        """The other hierarchies, for exactly the processes moved back (the slot now
        holds the next holder's processes too)."""
        lead, back = self._lead(), self._back or []
        for kind, (src, _) in self.moves.items():
            if kind != lead:
                self._follow(src, back)
        self._back = None
        self.applied = False

    def pids(self) -> list[int]:
        return list(self.moved)

    def members(self) -> list[int] | None:
        """The processes in the slot now (the holder's, its children since included):
        the first moved hierarchy's slot directory; None before it is applied."""
        if not self.applied or not self.moves:
            return None
        kind = self._lead() or next(iter(self.moves))
        return _procs(self.moves[kind][1])

    # -- the next holder's cpuset ahead (krex.enforce.enforcer.Enforcement.prefetch) ---

    def stage(self, job: JobTarget, pids: list[int]) -> list[int]:
        """Put ``job``'s processes, frozen in this device's subtree, into the slot's v1
        cpuset now, after this region's grant: frozen, they cannot run on the reserved
        cores, and a handoff to ``job`` then moves them in the freezing hierarchy only
        (the cpuset move is one cgroup write, and an interrupt to the core the process
        last ran on, less on the grant path).  The PIDs put there; none when ``job``'s
        cpuset is not the one this slot moves from (v2 cpusets are per job)."""
        move = self.moves.get("cpuset")
        cg = job.cgroups
        if move is None or cg is None or cg.cpuset != move[0] or cg.v2 == cg.cpuset:
            return []
        return self._follow(move[1], pids)

    def unstage(self, pids: list[int]) -> None:
        """Staged processes back into their device's cpuset (still frozen): those of
        ``pids`` still in the slot's cpuset (not the holder's)."""
        move = self.moves.get("cpuset")
        if move is not None and pids:
            there = set(_procs(move[1]))
            self._follow(move[0], [pid for pid in pids if pid in there])
