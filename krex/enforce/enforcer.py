"""Apply a region's host enforcement in order and undo it in reverse (a frozen device
subtree excepted: it is thawed first, once the holder's counters are read).

:meth:`Enforcer.enter` builds the operations (``pre_ops`` such as the GPU
gate and drain, then freeze of the siblings, then CPU isolation), registers a
guardian lease carrying every operation's undo records, and applies them in
an :class:`contextlib.ExitStack`.  :meth:`Enforcement.exit` reverts them and
returns the host part of the region report (:class:`~krex.protocol.report.HostEvidence`);
:attr:`Enforcement.reasons` says what kept the region from being clean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from krex.enforce.cgroups import CgroupLayout
from krex.enforce.contention import (
    Contention,
    delay_measurable,
    judge,
    ns_to_ms,
    unmeasurable,
)
from krex.enforce.freeze import FREEZERS, SignalFreeze, SubtreeFreeze
from krex.enforce.isolation import CpuIsolation, SlotIsolation, default_cores
from krex.enforce.job import JobTarget
from krex.enforce.operation import Operation
from krex.enforce.schedstat import Counts, HolderCounters
from krex.enforce.shield import Shield, configured_mode
from krex.enforce.shield import evidence as shield_evidence
from krex.enforce.slot import HolderSlot
from krex.errors import EnforcementFailed
from krex.protocol.report import HostEvidence, Reason, ReasonCode, Step

if TYPE_CHECKING:
    from krex.enforce.guardian import GuardianClient
    from krex.enforce.handoff import Prepared
    from krex.enforce.process import ProcessRef

FREEZE_CHOICES = ("auto", "cgroup2", "cgroup1", "signal", "off")
_SUBTREE_KINDS = {"cgroup2": "v2", "cgroup1": "freezer"}  # backends that freeze a subtree
_lease_ids = itertools.count(1)


@dataclass
class EnforceConfig:
    freeze: str = "auto"  # auto | cgroup2 | cgroup1 | signal | off
    freeze_scope: str = "device"  # device | node (the daemon picks the siblings)
    isolate: bool = True
    measure_cores: list[int] | None = None  # None: default_cores()
    lease_margin_s: float = 5.0
    freeze_timeout_s: float = 2.0
    shield: str = field(default_factory=configured_mode)  # auto|on|off|affinity (KREX_SHIELD)


class Enforcer:
    """Builds and applies the host operations of each region on this node."""

    def __init__(
        self, config: EnforceConfig, layout: CgroupLayout, guardian: GuardianClient | None = None
    ) -> None:
        if config.freeze not in FREEZE_CHOICES:
            raise ValueError(f"freeze must be one of {FREEZE_CHOICES}, not {config.freeze!r}")
        self.config = config
        self.layout = layout
        self.guardian = guardian
        self.all_cores = sorted(os.sched_getaffinity(0))
        self.shield = Shield(layout, guardian, config.shield)  # unmanaged tasks: shield.py

    def cores(self) -> list[int]:
        if self.config.measure_cores is not None:
            return sorted(self.config.measure_cores)
        return default_cores(self.all_cores)

    def freeze_backend(self) -> tuple[str | None, str]:
        """(backend name, why) for the configured choice; None when unavailable or off."""
        choice = self.config.freeze
        if choice == "off":
            return None, "disabled by configuration (freeze=off)"
        usable = self._freeze_usable()
        if choice == "auto":
            return next(k for k in ("cgroup2", "cgroup1", "signal") if usable[k][0]), ""
        return (choice, "") if usable[choice][0] else (None, usable[choice][1])

    def _freeze_usable(self) -> dict[str, tuple[bool, str]]:
        layout = self.layout
        return {
            "cgroup2": (layout.v2_writable, layout.reasons.get("v2", "")),
            "cgroup1": (layout.freezer_writable, layout.reasons.get("freezer", "")),
            "signal": (True, ""),
        }

    def backends(self) -> dict:
        usable = self._freeze_usable()
        chosen, why = self.freeze_backend()
        iso = CpuIsolation(JobTarget(0), [], self.cores(), self.all_cores).available()
        cpuset = self.layout.cpuset_writable or self.layout.v2_cpuset
        return {
            "freeze": {k: {"ok": ok, "why": w} for k, (ok, w) in usable.items()},
            "freeze_chosen": chosen,
            "freeze_why_not": why,
            "isolate": {
                "cpuset": {
                    "ok": cpuset,
                    "why": "" if cpuset else self.layout.reasons.get("cpuset", ""),
                },
                "affinity": {"ok": iso[0], "why": iso[1]},
            },
            "measure_cores": self.cores(),
            "all_cores": self.all_cores,
        }

    def _ops(
        self,
        holder: JobTarget,
        siblings: list[JobTarget],
        others: list[JobTarget],
        exclude: set[int],
    ) -> tuple[list, list[Reason]]:
        ops: list = []
        skipped: list[Reason] = []
        backend, why = self.freeze_backend()
        kind = _SUBTREE_KINDS.get(backend or "")
        dev = holder.cgroups.device if holder.cgroups else None
        subtree = kind is not None and dev is not None and kind in dev.parent
        slot = HolderSlot(holder)
        for k in ("v2", "freezer"):
            if not subtree or k != kind:
                slot.moves.pop(k, None)
        if not (self.config.isolate and "cpuset" in (dev.slot if dev else {})):
            slot.moves.pop("cpuset", None)
        if slot.moves:
            ops.append(slot)  # out of its device's subtree before that is frozen
        frozen: set[str] = set()
        if backend is None:
            skipped.append(Reason.mechanism("freeze", why, disabled=self.config.freeze == "off"))
        elif subtree and kind is not None and dev is not None:
            devices = {dev.device: dev.parent[kind]}
            for t in siblings:
                d = t.cgroups.device if t.cgroups else None
                if d is not None and kind in d.parent:
                    devices[d.device] = d.parent[kind]
            frozen = set(devices)
            ops.append(SubtreeFreeze(kind, list(devices.values()), siblings,
                                     timeout_s=self.config.freeze_timeout_s, exclude=exclude))
        else:
            ops.append(
                FREEZERS[backend](siblings, timeout_s=self.config.freeze_timeout_s, exclude=exclude)
            )
        if self.config.isolate:
            # Frozen siblings cannot run: only unfrozen jobs need moving off the cores.
            movable = list(others) + ([] if backend else list(siblings))
            if "cpuset" in slot.moves:
                ops.append(SlotIsolation(holder, movable, frozen, self.cores(), self.all_cores))
            else:
                ops.append(CpuIsolation(holder, movable, self.cores(), self.all_cores))
            ops.extend(self.shield.ops(holder, self.cores(), exclude))
        else:
            skipped.append(Reason.mechanism("isolate", "disabled by configuration (isolate=false)",
                                            disabled=True))
        return ops, skipped

    def enter(
        self,
        holder: JobTarget,
        siblings: list[JobTarget],
        *,
        max_hold_s: float,
        pre_ops: list[Operation] | tuple = (),
        others: list[JobTarget] | tuple = (),
    ) -> Enforcement:
        """Freeze ``siblings``, give ``holder`` the reserved cores, keep ``others``
        (jobs not frozen, e.g. on other devices) and unfrozen siblings off them."""
        holder_refs = holder.processes()
        ops, skipped = self._ops(holder, siblings, list(others), {r.pid for r in holder_refs})
        enforcement = Enforcement(self, holder, siblings)
        enforcement.gaps.extend(skipped)
        enforcement.counters = HolderCounters.begin(holder_refs)
        enforcement.t0_ns = time.monotonic_ns()
        enforcement.start(list(pre_ops) + ops, max_hold_s + self.config.lease_margin_s)
        return enforcement

    def hand_over(self, old: Enforcement, holder: JobTarget, siblings: list[JobTarget], *,
                  max_hold_s: float, others: list[JobTarget] | tuple = (),
                  pre_ops: list[Operation] | tuple = (),
                  prepared: list | None = None) -> Enforcement | None:
        """The next region on ``old``'s device, taken over without undoing what both
        need (:mod:`krex.enforce.handoff`); None when it cannot be, and nothing changed.
        ``prepared``: its operations from :func:`krex.enforce.handoff.prepare`."""
        from krex.enforce.handoff import hand_over

        return hand_over(old, holder, siblings, list(others),
                         max_hold_s + self.config.lease_margin_s, pre_ops, prepared)


def _backend(op: object) -> str:
    return str(getattr(op, "full_backend", None) or getattr(op, "backend", type(op).__name__))


class Enforcement:
    """The applied operations of one region; :meth:`exit` undoes them."""

    def __init__(self, enforcer: Enforcer, holder: JobTarget, siblings: list[JobTarget]) -> None:
        self.enforcer = enforcer
        self.holder = holder
        self.siblings = siblings
        self.steps: list[Step] = []
        self.gaps: list[Reason] = []  # mechanisms not applied (disabled, unavailable)
        self.applied: list = []
        self.lease_id = next(_lease_ids)
        self.stack = contextlib.ExitStack()
        self.counters: HolderCounters | None = None
        self.t0_ns = time.monotonic_ns()
        self.contention: Contention | None = None
        self.contention_reasons: list[Reason] = []
        self.report: HostEvidence | None = None
        self.revoked = False
        self.freeze_step: Step | None = None
        self.leased: list[dict] | None = None
        self.ended_ns: int | None = None  # set by a handoff: the region ended there
        self.handed_from: int | None = None  # the lease id it was handed over from
        self.handed_prepared = False  # ... with operations from handoff.prepare
        self.pending_lease: tuple[Enforcement, float] | None = None  # handoff: see handoff.py
        self._early: set[int] = set()  # ops reverted ahead of the stack (_thaw_first)
        # job id -> its counters, read while it is frozen in a subtree this region holds
        # frozen (prefetch): the next holder's handoff then reads none on the grant path
        self.prefetched: dict[int, HolderCounters] = {}
        # job id -> its frozen processes put into the slot's v1 cpuset ahead (prefetch;
        # HolderSlot.stage): at most one job; taken by a handoff to it, else put back
        self.staged: dict[int, list[int]] = {}
        self.prepared: Prepared | None = None  # the next handoff's operations (handoff.prepare)
        self.kept = False  # renewed: entered on what the holder's previous region kept
        self.lease_until = 0.0  # when the guardian's lease runs out (monotonic)

    def start(self, ops: list, lease_s: float) -> None:
        usable = [op for op in ops if self._check(op)]
        self._lease(usable, lease_s)
        try:
            for op in usable:
                self._apply(op)
        except Exception as e:
            self.exit()
            if isinstance(e, EnforcementFailed):  # keep the specific error (DrainTimeout, ...)
                e.host = self.report
                raise
            err = EnforcementFailed(f"enforcement failed at {self.steps[-1].name}: {e}")
            err.host = self.report
            raise err from e
        self._lease(usable, lease_s)  # now with what apply found (late forks)
        for op in usable:  # what needed those records leased first (the shield's recheck)
            after = getattr(op, "after_lease", None)
            if after is not None:
                after()

    def _check(self, op: Operation) -> bool:
        ok, why = op.available()
        if not ok:
            self.gaps.append(Reason.mechanism(op.name, why))
        return ok

    def _lease(self, ops: list, lease_s: float) -> None:
        guardian = self.enforcer.guardian
        if guardian is None:
            return
        records = [rec for op in reversed(ops) for rec in op.undo_records()]
        if not records and self.leased is None:
            return  # nothing the guardian could undo: no lease, no journal write
        if records != self.leased:
            guardian.lease(self.lease_id, lease_s, records)
            self.leased, self.lease_until = records, time.monotonic() + lease_s

    def _apply(self, op: Operation) -> None:
        step = Step(op.name, _backend(op))
        self.steps.append(step)
        t0 = time.perf_counter()
        try:
            op.apply()
        except Exception as e:
            step.error = f"{type(e).__name__}: {e}"
            self.stack.callback(self._revert, op, step)  # undo the partial apply too
            raise
        finally:
            step.apply_ms = round((time.perf_counter() - t0) * 1e3, 3)
        step.ok, step.backend = True, _backend(op)
        incomplete = getattr(op, "incomplete", None)
        if incomplete:  # timed out: what it did stays applied (and is undone at exit)
            step.ok, step.timed_out, step.error = False, True, str(incomplete)
        if op.name == "freeze":
            self.freeze_step = step
            frozen_count = getattr(op, "frozen_count", None)
            if frozen_count is not None and not getattr(op, "count_at_exit", False):
                step.processes = frozen_count()
        self.applied.append(op)
        self.stack.callback(self._revert, op, step)

    def _revert(self, op: Operation, step: Step) -> None:
        if id(op) in self._early:  # reverted already (see _thaw_first)
            return
        t0 = time.perf_counter()
        try:
            op.revert()
        except Exception as e:  # noqa: BLE001 - recorded in the step; keep reverting the rest
            step.ok = False
            step.error = (step.error or "") + f" revert: {type(e).__name__}: {e}"
        step.revert_ms = round((time.perf_counter() - t0) * 1e3, 3)
        incomplete = getattr(op, "incomplete", None)
        if incomplete and not step.timed_out:  # found out at the end (SubtreeFreeze)
            step.ok, step.timed_out, step.error = False, True, str(incomplete)

    @property
    def reasons(self) -> list[Reason]:
        """Why this region's host enforcement is not clean: gaps, failed steps, lease expiry."""
        out = list(self.gaps)
        out += [_step_reason(s) for s in self.steps if not s.ok]
        out += self.contention_reasons
        if self.revoked:
            out.append(Reason(ReasonCode.LEASE_EXPIRED,
                              "lease: the guardian's lease expired: region revoked",
                              {"lease_id": self.lease_id}))
        return out

    def exit(self) -> HostEvidence:
        """Revert in reverse order, end the lease, return the host evidence."""
        if self.report is not None:
            return self.report
        self._judge()  # before anything is thawed or moved back
        if self.pending_lease is not None:  # handed over, never leased: lease it first
            from krex.enforce.handoff import lease_handed

            lease_handed(self)
        self._thaw_first()
        self._count_frozen()
        self.stack.close()
        guardian = self.enforcer.guardian
        if guardian is not None and self.leased is not None:
            expired = guardian.expired()
            self.revoked = self.lease_id in expired or self.handed_from in expired
            guardian.end(self.lease_id)
        self.report = self._report()
        return self.report

    def keepable(self) -> bool:
        """Whether every applied operation may stay applied for the holder's next region
        (each says so: ``keepable``; the affinity shield and the GPU steps do not)."""
        return all(getattr(op, "keepable", False) for op in self.applied)

    def checkpoint(self) -> HostEvidence:
        """This region's evidence, as :meth:`exit` gives it, with everything kept applied
        for its holder's next region (:meth:`renew`) or undone later (:meth:`exit`)."""
        self._judge()
        for op in self.applied:
            checkpoint = getattr(op, "checkpoint", None)
            if checkpoint is not None:
                checkpoint()
        report = self._report()
        self.counters = None  # judged: an undo of the kept enforcement judges nothing again
        return report

    def holder_now(self) -> list[ProcessRef]:
        """The holder's processes now: its slot's members where it was moved into one
        (children born since are there too), else found again."""
        from krex.enforce.process import ProcessRef, start_time

        slot = next((op for op in self.applied if isinstance(op, HolderSlot)), None)
        pids = slot.members() if slot is not None else None
        if pids is None:
            return self.holder.processes()
        return [ProcessRef(pid, st) for pid in pids if (st := start_time(pid)) is not None]

    def renew(self, lease_s: float) -> None:
        """The holder's next region on what :meth:`checkpoint` kept: its counters begin
        now, for its processes now, each step is reported as kept (nothing applied),
        and the guardian's lease runs for the new region's hold."""
        self.counters = HolderCounters.begin(self.holder_now())
        self.t0_ns = time.monotonic_ns()
        self.contention, self.contention_reasons = None, []
        self.kept = True
        for op in self.applied:
            renew = getattr(op, "renew", None)
            if renew is not None:
                renew()
        self.steps = [dataclasses.replace(s, apply_ms=0.0, revert_ms=None, kept=True)
                      for s in self.steps]
        if self.freeze_step is not None:
            self.freeze_step = next((s for s in self.steps if s.name == "freeze"), None)
        guardian = self.enforcer.guardian  # a lease that covers the new hold is kept as is
        if guardian is not None and self.leased is not None \
                and time.monotonic() + lease_s > self.lease_until:
            guardian.lease(self.lease_id, lease_s, self.leased)
            self.lease_until = time.monotonic() + lease_s

    def prefetch(self, job: JobTarget) -> bool:
        """Read ``job``'s counters now, after this region's grant, if it is frozen by a
        device subtree this region holds frozen: they stand still until a handoff moves
        it into the slot, so that handoff takes them (:func:`krex.enforce.handoff.hand_over`)
        instead of reading them on the grant path.  Read earlier than needed, they can
        only count more of the holder's run delay, never less (it is frozen meanwhile)."""
        if job.job_id == self.holder.job_id or self.report is not None:
            return False
        cg = job.cgroups
        dev = cg.device if cg is not None else None
        frozen = [op for op in self.applied if isinstance(op, SubtreeFreeze) and op.frozen]
        if dev is None or not any(dev.parent.get(op.kind) in op.frozen for op in frozen):
            return False
        if job.may_run_outside():
            return False
        refs = job.processes()
        self.prefetched[job.job_id] = HolderCounters.begin(refs)
        self._stage(job, [r.pid for r in refs])
        return True

    def _stage(self, job: JobTarget, pids: list[int]) -> None:
        """``job`` (frozen here, likely the next holder) into the slot's v1 cpuset ahead
        of its handoff (:meth:`HolderSlot.stage`); another job staged before is put back
        first: a staged process stays frozen until a handoff to its job takes it, or is
        put back before any thaw (:meth:`_thaw_first`)."""
        slot = next((op for op in self.applied if isinstance(op, HolderSlot)), None)
        if slot is None or job.job_id in self.staged:
            return
        self._unstage()
        staged = slot.stage(job, pids)
        if staged:
            self.staged[job.job_id] = staged

    def _unstage(self) -> None:
        slot = next((op for op in self.applied if isinstance(op, HolderSlot)), None)
        staged, self.staged = self.staged, {}
        if slot is not None:
            for pids in staged.values():
                slot.unstage(pids)

    def _thaw_first(self) -> None:
        """A device subtree this region froze is thawed as soon as the holder's counters
        are read, before the rest of the undo (shield, isolation, the slot) and the count
        of frozen processes: at a chain's end the next holder is among the frozen, and
        must run to ask.  The holder's region is over (its counters are read); the
        siblings run on the unreserved cores until the isolation is undone next (a
        sibling staged in the slot's cpuset is put back first)."""
        if self.staged:
            self._unstage()
        for op in self.applied:
            if isinstance(op, SubtreeFreeze) and op.frozen and self.freeze_step is not None:
                self._revert(op, self.freeze_step)
                self._early.add(id(op))

    def _count_frozen(self) -> None:
        """Processes a subtree freeze stopped: counted at the end, off the grant path."""
        for op in self.applied:
            if op.name == "freeze" and getattr(op, "count_at_exit", False) and self.freeze_step:
                self.freeze_step.processes = op.frozen_count()

    def _judge(self) -> None:
        """Read the holder's counters once at region end and judge contention."""
        if self.counters is None:
            return
        isolated = any(op.name == "isolate" for op in self.applied)
        cores = self.enforcer.cores() if isolated else self.enforcer.all_cores
        end_ns = self.ended_ns or time.monotonic_ns()
        self.contention = Contention(self.counters.totals(), end_ns - self.t0_ns,
                                     cores, confined=isolated)
        if not delay_measurable():
            self.contention_reasons = [unmeasurable()]
            return
        pids = {r.pid for r in self.counters.refs}
        self.contention_reasons = judge(self.contention, pids)

    def _report(self) -> HostEvidence:
        freeze = self.freeze_step
        c = self.contention
        totals = c.totals if c is not None else Counts()
        return HostEvidence(
            steps=self.steps,
            siblings_frozen=len(self.siblings) if freeze else 0,
            processes_frozen=(freeze.processes or 0) if freeze else 0,
            freeze_backend=freeze.backend if freeze else "off",
            holder_involuntary_switches=totals.switches,
            holder_migrations=totals.migrations,
            holder_run_delay_ms=ns_to_ms(totals.delay_ns),
            holder_cpu_ms=ns_to_ms(totals.cpu_ns),
            run_delay_threshold_ms=ns_to_ms(c.threshold_ns) if c is not None else None,
            holder_cores=list(c.cores) if c is not None else None,
            shield=shield_evidence(self.applied, self.enforcer.shield),
            handed_over=self.handed_from is not None,
            handover_prepared=self.handed_prepared,
            kept=self.kept,
        )


def _step_reason(step: Step) -> Reason:
    if step.timed_out:
        return Reason(ReasonCode.STEP_TIMEOUT, f"{step.name}: did not finish in time: {step.error}",
                      {"step": step.name, "error": step.error})
    return Reason(ReasonCode.STEP_FAILED, f"{step.name}: {step.error}",
                  {"step": step.name, "error": step.error})


__all__ = ["EnforceConfig", "Enforcer", "Enforcement", "FREEZE_CHOICES", "SignalFreeze"]
