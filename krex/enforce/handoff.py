"""Overlapped handoff: one device's enforcement passes from holder to holder.

When a region ends and the next grant is on the same device, undoing
everything (thaw the device subtree, widen the shield, give the other
cpusets their cores back) only to redo it all for the next holder is most of
a handoff's cost.  :func:`hand_over` keeps applied what both regions need:
the device subtree stays frozen, the slot keeps the reserved cores, the other
devices' cpusets and the shield stay narrowed.  Only the holders move: the
outgoing holder's processes go back into their job cgroups (under the frozen
parent: they freeze on arrival), then the incoming holder's into the slot
(they thaw on arrival), in that order, so the two never run at once.  The new
region is leased to the guardian before the old lease ends, so every applied
change has an undo record at every moment.

The outgoing region's report is made afterwards, by its ordinary
:meth:`~krex.enforce.enforcer.Enforcement.exit` (after the grant is sent),
and is as truthful as one that thawed: its freeze is confirmed (a subtree
not yet "frozen" at the handoff is confirmed after it, with the outgoing
holder now inside, which can only delay the confirmation, never fake it), its
frozen processes are counted (the incoming holder's, which left for the slot
meanwhile, included), its holder's counters are judged over the region it
held, and tasks that reached the root cpuset meanwhile are named (and swept).

A GPU gate/drain step is carried the same way: the gates of jobs that stay
siblings stay closed (no close, no drain wait), the outgoing holder's gate is
closed and only its queued GPU work is waited for — before it is moved among
the frozen — and the incoming holder's gate is opened.

The next holder's operations are worked out ahead (:func:`prepare`, after the
grant, while the likely next holder is frozen): at the handoff, when the holder,
its siblings and the other jobs are the same jobs in the same state as then
(:func:`job_key`), only the checks that can change in between run on the grant
path (the outgoing region not revoked or reported, its lease not expired, the
holder inside its cgroup, the GPU step's match), not the building and matching
of every operation.

A handoff is refused (``None``: the caller undoes and sets up as before)
when something applied cannot be carried as it is: a checkpoint-lock GPU
step, per-process or signal freezing, processes outside their cgroups, other
cpusets to narrow, other reserved cores, a lease the guardian expired.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from krex.enforce.freeze import SubtreeFreeze
from krex.enforce.gatedrain import GateDrain
from krex.enforce.isolation import SlotIsolation
from krex.enforce.job import JobTarget
from krex.enforce.schedstat import HolderCounters
from krex.enforce.shield import ShieldRegion
from krex.enforce.slot import HolderSlot
from krex.protocol.report import Step

if TYPE_CHECKING:
    from krex.enforce.enforcer import Enforcement

CARRIED = (GateDrain, HolderSlot, SubtreeFreeze, SlotIsolation, ShieldRegion)


def _matches(old: object, fresh: object, outgoing: int) -> bool:
    """Whether ``fresh`` (built for the next holder) would apply what ``old`` did."""
    if type(old) is not type(fresh):
        return False
    if isinstance(old, GateDrain):
        assert isinstance(fresh, GateDrain)
        return old.carriable(fresh, outgoing)
    if isinstance(old, HolderSlot):
        assert isinstance(fresh, HolderSlot)
        return ({k: d for k, (_, d) in old.moves.items()}
                == {k: d for k, (_, d) in fresh.moves.items()})
    if isinstance(old, SubtreeFreeze):
        assert isinstance(fresh, SubtreeFreeze)
        return (old.carriable() and not fresh.stragglers.targets and old.kind == fresh.kind
                and old.parents == fresh.parents)
    if isinstance(old, SlotIsolation):
        assert isinstance(fresh, SlotIsolation)
        return old.carriable(fresh)
    assert isinstance(old, ShieldRegion) and isinstance(fresh, ShieldRegion)
    return old.carriable(fresh)


def plan(old: Enforcement, holder: JobTarget, siblings: list[JobTarget],
         others: list[JobTarget], exclude: set[int], pre_ops: list | tuple = ()) -> list | None:
    """The next region's operations, if every one can take over the applied one."""
    if not _carriable_now(old, holder):
        return None
    fresh, skipped = old.enforcer._ops(holder, siblings, others, exclude)
    fresh = list(pre_ops) + fresh
    if skipped or len(fresh) != len(old.applied):
        return None
    outgoing = old.holder.job_id
    if not all(_matches(o, f, outgoing) for o, f in zip(old.applied, fresh, strict=True)):
        return None
    return fresh if _lease_alive(old) else None


def _carriable_now(old: Enforcement, holder: JobTarget) -> bool:
    if old.report is not None or old.revoked or not old.applied:
        return False
    if any(not isinstance(op, CARRIED) for op in old.applied):
        return False
    if not any(isinstance(op, SubtreeFreeze) for op in old.applied):
        return False
    return not holder.may_run_outside()


def _lease_alive(old: Enforcement) -> bool:
    """Not expired (else the guardian undid what it carries); on the grant path, so known
    from the lease's own clock where it can be (no read of the guardian's pipe)."""
    guardian = old.enforcer.guardian
    return (guardian is None or guardian.surely_active(old.lease_id)
            or old.lease_id not in guardian.expired())


def job_key(holder: Any, siblings: list, others: list) -> tuple:
    """What the targets and operations of a handoff are made from, for the daemon's jobs:
    the same key, the same operations (the same jobs, anchors, groups and cgroups)."""
    return tuple((j.job_id, id(j), j.root, j.group, id(j.cgroups), j.kind, j.owner,
                  frozenset(j.members)) for j in (holder, *siblings, None, *others)
                 if j is not None) + (len(siblings),)


@dataclass
class Prepared:
    """A handoff's targets and operations (but a GPU step), worked out ahead."""

    key: tuple
    holder: JobTarget
    siblings: list[JobTarget]
    others: list[JobTarget]
    ops: list


def prepare(old: Enforcement, key: tuple, holder: JobTarget, siblings: list[JobTarget],
            others: list[JobTarget]) -> bool:
    """After ``old``'s grant: the operations a handoff to ``holder`` would apply, kept
    on ``old`` for that handoff (:func:`take_prepared`).  False: it could not take over."""
    old.prepared = None
    if not _carriable_now(old, holder):
        return False
    fresh, skipped = old.enforcer._ops(holder, siblings, others, set())
    gpu = len(old.applied) - len(fresh)  # the GPU step comes at the handoff (pre_ops)
    if skipped or gpu not in (0, 1) or (gpu and not isinstance(old.applied[0], GateDrain)):
        return False
    outgoing = old.holder.job_id
    if not all(_matches(o, f, outgoing) for o, f in zip(old.applied[gpu:], fresh, strict=True)):
        return False
    old.prepared = Prepared(key, holder, siblings, others, fresh)
    return True


def take_prepared(old: Enforcement, key: tuple) -> Prepared | None:
    """The prepared handoff, once, if it was made for exactly these jobs as they are."""
    prepared, old.prepared = old.prepared, None
    return prepared if prepared is not None and prepared.key == key else None


def hand_over(old: Enforcement, holder: JobTarget, siblings: list[JobTarget],
              others: list[JobTarget], lease_s: float,
              pre_ops: list | tuple = (), prepared: list | None = None) -> Enforcement | None:
    """The next region's enforcement, taken over from ``old`` (which then only reports).
    ``pre_ops``: the next region's GPU step (a :class:`GateDrain`), as for ``enter``.
    ``prepared``: the rest of its operations from :func:`prepare`, for these targets."""
    # No holder process may be outside its cgroup (plan checks), so nothing needs
    # excluding from a signal freeze, and its cgroup lists all of it.
    if prepared is None:
        fresh = plan(old, holder, siblings, others, set(), pre_ops)
    else:
        fresh = _prepared_ops(old, holder, list(pre_ops), prepared)
    if fresh is None:
        return None
    new = type(old)(old.enforcer, holder, siblings)  # an Enforcement (no import: no cycle)
    # Frozen (it waited in the frozen subtree), its counters stand still until the slot
    # move below thaws it: this is its region's start.  Read after the previous grant
    # (Enforcement.prefetch) while it was frozen in this subtree, they are taken as they
    # are when its processes are the same ones.
    pre = old.prefetched.pop(holder.job_id, None)
    refs = _same_processes(holder, pre)
    members = None
    if refs is None:
        refs = holder.processes()
        same = pre is not None and set(pre.refs) == set(refs)
        new.counters = pre if pre is not None and same else HolderCounters.begin(refs)
    else:
        new.counters = pre
        assert holder.cgroups is not None  # the cgroup read just made: the slot move's own
        members = (holder.cgroups.own()[0], sorted(r.pid for r in refs))
    new.prefetched, old.prefetched = old.prefetched, {}  # the subtree stays frozen
    old.ended_ns = time.monotonic_ns()
    incoming: set[int] = set()
    try:
        _take_over(old, new, fresh, holder, refs, incoming, members,
                   old.staged.get(holder.job_id, []))
    except BaseException:
        old.ended_ns = None  # not handed over: it ends when it is undone
        raise
    old.staged.pop(holder.job_id, None)  # in the slot now; another staged job stays so
    new.staged, old.staged = old.staged, {}
    new.handed_from = old.lease_id
    new.handed_prepared = prepared is not None
    new.pending_lease = (old, lease_s)  # sent by lease_handed(), after the grant
    new.t0_ns = time.monotonic_ns()
    return new


def _prepared_ops(old: Enforcement, holder: JobTarget, pre_ops: list,
                  prepared: list) -> list | None:
    """``plan``'s answer from a prepared one: what can change since it was made."""
    if not _carriable_now(old, holder):
        return None
    fresh = pre_ops + prepared
    if len(fresh) != len(old.applied):
        return None  # a GPU step now and none then, or the other way round
    outgoing = old.holder.job_id
    if pre_ops and not _matches(old.applied[0], pre_ops[0], outgoing):
        return None
    return fresh if _lease_alive(old) else None


def _same_processes(holder: JobTarget, pre: HolderCounters | None) -> list | None:
    """The prefetched processes, when the job's cgroup holds exactly their PIDs now: one
    read instead of one per process.  Frozen since the prefetch, its processes could not
    fork; a PID can only have been reused if its process died and another one was put
    into this cgroup meanwhile (by the daemon, which would have changed the job), so
    the same PIDs are the same processes.  None: look them up as usual."""
    if pre is None or holder.cgroups is None:
        return None
    pids = holder.cgroups.pids()
    if not pids or pids != sorted(r.pid for r in pre.refs):
        return None
    return list(pre.refs)


def _take_over(old: Enforcement, new: Enforcement, fresh: list, holder: JobTarget,
               refs: list, incoming: set[int],
               members: tuple[str, list[int]] | None = None,
               staged: list[int] | tuple = ()) -> None:
    for was, op in zip(old.applied, fresh, strict=True):
        t0 = time.perf_counter()
        if isinstance(op, GateDrain):  # first: the outgoing holder's GPU work drains
            was.hand_over(op, holder.job_id)
        elif isinstance(op, HolderSlot):
            was.revert_lead()  # the outgoing holder back into the frozen subtree: it stops
            # the incoming holder out of it, onto the reserved cores
            op.apply(source_frozen=True, members=members, staged=staged)
            incoming |= set(op.pids())
        elif isinstance(op, SubtreeFreeze):
            was.hand_over(op, incoming)
        elif isinstance(op, ShieldRegion):
            was.hand_over(op, {r.pid for r in refs})
        else:
            was.hand_over(op)
        step = Step(op.name, _step(old, was).backend, ok=True,
                    apply_ms=round((time.perf_counter() - t0) * 1e3, 3))
        new.steps.append(step)
        new.applied.append(op)
        new.stack.callback(new._revert, op, step)
        if op.name == "freeze":
            new.freeze_step = step


def lease_handed(new: Enforcement) -> None:
    """After the grant is sent: the outgoing holder's move back in the hierarchies
    other than the freezing one (it is frozen: where it may run can wait), then the
    new region's lease and the end of the old one.

    No ack is waited for, and nothing is lost if the daemon dies before this runs:
    the old lease is still active and its undo records are the new region's (the
    same subtrees to thaw, the same cpusets to give back, the same shield to
    release; the slot move needs none), so the guardian undoes exactly what is
    applied.  The pipe keeps lease-then-end in order.  Only its expiry is the old
    region's: a region that finds either lease expired at its end is revoked."""
    pending, new.pending_lease = new.pending_lease, None
    if pending is None:
        return
    old, lease_s = pending
    for op in old.applied:  # the outgoing holder's other hierarchies (v1 cpuset)
        if isinstance(op, HolderSlot):
            if not new.staged:  # it stays, frozen, in the slot's cpuset: staged there
                kept = op.keep_staged()  # for a handoff back to it (two jobs take turns)
                if kept:
                    new.staged[old.holder.job_id] = kept
            old._revert(op, _step(old, op))
    # a carried shield looks for cpusets made since it was planned (at most once a second)
    late = [op for op in new.applied if isinstance(op, ShieldRegion) and op.recheck()]
    guardian = old.enforcer.guardian
    # one write: the guardian wakes and journals once, and reads the new lease before
    # the old one's end — never a moment unleased
    with guardian.batch() if guardian is not None else contextlib.nullcontext():
        new._lease(new.applied, lease_s)
        if guardian is not None and old.leased is not None:
            guardian.end(old.lease_id)
            old.leased = None
    for op in late:  # their cores back are in the lease just sent: narrow them now
        op.after_lease()


def _step(enf: Enforcement, op: object) -> Step:
    name = getattr(op, "name", "")
    return next(s for s in enf.steps if s.name == name)


__all__ = ["CARRIED", "Prepared", "hand_over", "job_key", "lease_handed", "plan", "prepare",
           "take_prepared"]
