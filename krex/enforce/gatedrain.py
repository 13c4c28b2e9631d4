"""Gate and drain: the GPU half of a region, applied before freezing.

For each sibling job on the device: close its gate (new launches park in the
interposer), then wait until every interposed process of the job has
acknowledged that its queued GPU work finished.  Closing all gates first and
then waiting for all of them at once, against one deadline, lets the siblings
drain in parallel: a grant waits for the slowest, not for the sum.  A sibling with no active
interposer has launched nothing through it: it is gated (its gate closes, so
a first launch would park) and listed as idle in the report.  When a drain
times out the policy decides: ``abort`` (default: revert and raise
:class:`~krex.errors.DrainTimeout`), ``wait`` (keep waiting up to the
region's maximum hold) or ``kill`` (SIGKILL the processes that did not ack,
only those verified — pid and start time — as members of the job).

What the operation saw that makes the region not clean is in
:meth:`GateDrain.findings` (``{"what", "why"}`` entries; the daemon turns them into
typed reasons not clean):
a drain acknowledged with a failure (a synchronisation error, default-stream
work left during a stream capture), and any sibling process that reached the
driver around the gate (entry points left unwrapped, calls made without a
slot).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from krex.enforce.gate import GateFile, drain_reason
from krex.enforce.process import ProcessRef
from krex.errors import DrainTimeout

POLICIES = ("abort", "wait", "kill")


@dataclass
class GatedJob:
    job_id: int
    gate: GateFile
    path: str
    slot: int = 0
    # The job's live processes (pid + start time); the kill policy signals only these.
    members: Callable[[], list[ProcessRef]] | None = None


@dataclass
class GateDrain:
    """An :class:`~krex.enforce.operation.Operation` over the siblings' gate files."""

    jobs: list[GatedJob]
    timeout_s: float = 5.0
    policy: str = "abort"
    max_wait_s: float = 60.0
    name: str = "gate_drain"
    backend: str = "interposer"
    acks: dict[int, float] = field(default_factory=dict)
    # Jobs none of whose processes has launched GPU work through the interposer:
    # nothing of theirs can be queued (a process that reaches the GPU without the
    # interposer is not seen here; on NVIDIA the NVML audit reports it).
    idle_jobs: list[int] = field(default_factory=list)
    # This region's drains acknowledged with a failure: (job id, pid, ack status).
    drain_failures: list[tuple[int, int, int]] = field(default_factory=list)
    _closed: list[GatedJob] = field(default_factory=list)
    # job id -> seconds from the gates' closing to that job's last ack (all wait at once)
    waited_s: dict[int, float] = field(default_factory=dict)

    def available(self) -> tuple[bool, str]:
        return True, ""

    def apply(self) -> None:
        generations = {}
        for job in self.jobs:
            if not job.gate.interposed(job.slot):
                self.idle_jobs.append(job.job_id)
            generations[job.job_id] = job.gate.close(job.slot)
            self._closed.append(job)
        self._drain_all(generations)
        for job in self.jobs:
            self.drain_failures += [(job.job_id, s.pid, s.ack_status)
                                    for s in job.gate.slots(job.slot)
                                    if s.ack_generation >= generations[job.job_id]
                                    and s.ack_status != 0]

    def _drain_all(self, generations: dict[int, int]) -> None:
        """Wait for every sibling's drain at once, against one deadline (issue 12): the
        grant waits as long as the slowest sibling, never one ``timeout_s`` after
        another.  At the deadline the policy acts on every sibling still pending
        together: ``abort`` raises, ``kill`` kills them (then one more ``timeout_s``
        for what is left), ``wait`` goes on until the region's maximum hold."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        last = start + (self.max_wait_s if self.policy == "wait" else 0.0)
        pending = list(self.jobs)
        pause = 20e-6
        while pending:
            pending = [job for job in pending if not self._drained(job, generations, start)]
            if not pending:
                return
            now = time.monotonic()
            if now > deadline:
                stuck = [(job, pids) for job in pending
                         if (pids := job.gate.pending(job.slot, generations[job.job_id]))]
                if self.policy == "kill" and stuck:
                    for job, pids in stuck:
                        self._kill(job, self._timeout(job, pids[0]))
                    deadline = time.monotonic() + self.timeout_s
                    continue
                if self.policy == "wait" and now < last:
                    deadline = last
                    continue
                if stuck:
                    raise self._timeout(*stuck[0])
                continue  # every one of them acked (or exited) just now
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _drained(self, job: GatedJob, generations: dict[int, int], start: float) -> bool:
        generation = generations[job.job_id]
        if job.gate.pending(job.slot, generation):
            return False
        self.acks.update(job.gate.acks(job.slot, generation))
        self.waited_s[job.job_id] = time.monotonic() - start
        return True

    def _timeout(self, job: GatedJob, pid: int | list[int]) -> DrainTimeout:
        pid = pid[0] if isinstance(pid, list) else pid
        return DrainTimeout(f"job {job.job_id}: pid {pid} did not drain its queued GPU work "
                            f"within {self.timeout_s} s", pid=pid, device=str(job.slot),
                            seconds=self.timeout_s)

    # -- overlapped handoff (krex.enforce.handoff) ---------------------------------------

    def carriable(self, fresh: GateDrain, outgoing: int) -> bool:
        """Whether ``fresh`` (the next region's) needs no gate closed here but the
        outgoing holder's (job id ``outgoing``)."""
        closed = {j.job_id for j in self._closed} | {outgoing}
        return (fresh.policy == self.policy and not fresh._closed
                and {j.job_id for j in fresh.jobs} <= closed)

    def hand_over(self, fresh: GateDrain, incoming: int) -> None:
        """``fresh`` keeps every gate closed that both regions close; only the outgoing
        holder's gate is closed (and its queued GPU work drained) and the incoming
        holder's opened.  If the drain fails nothing changes here (the gates this
        closed are opened again) and the error is raised."""
        kept = {j.job_id: j for j in self._closed}
        new = [j for j in fresh.jobs if j.job_id not in kept]
        generations = {}
        for job in new:
            if not job.gate.interposed(job.slot):
                fresh.idle_jobs.append(job.job_id)
            generations[job.job_id] = job.gate.close(job.slot)
        fresh._closed = [kept.get(j.job_id, j) for j in fresh.jobs]
        try:
            fresh.jobs = new  # wait for the newly closed only
            fresh._drain_all(generations)
            fresh.drain_failures += [(job.job_id, st.pid, st.ack_status) for job in new
                                     for st in job.gate.slots(job.slot)
                                     if st.ack_generation >= generations[job.job_id]
                                     and st.ack_status != 0]
        except BaseException:
            for job in new:
                job.gate.open(job.slot)
            fresh._closed = []
            raise
        finally:
            fresh.jobs = [j for j in fresh._closed]
        fresh.idle_jobs += [j.job_id for j in fresh.jobs if j.job_id in kept
                            and not j.gate.interposed(j.slot)]
        carried = {j.job_id for j in fresh._closed}
        self._closed, leave = [], [j for j in self._closed if j.job_id not in carried]
        for job in leave:  # the incoming holder (and any job no longer a sibling)
            job.gate.open(job.slot)

    def _kill(self, job: GatedJob, exc: DrainTimeout) -> None:
        """SIGKILL the slot's owner if it is a verified member of the job, else give up:
        the pid comes from a file the job can write."""
        owner = job.gate.owner(job.slot, exc.pid) if exc.pid is not None else None
        if owner is None:
            return  # gone (or its pid reused): no longer pending
        members = set(job.members()) if job.members is not None else set()
        if owner not in members:
            exc.message = (f"{exc.message}; not killed: pid {owner.pid} "
                           f"(start time {owner.start_time}) is not a verified member of the job")
            raise exc
        owner.send_signal(signal.SIGKILL)

    def findings(self) -> list[dict[str, str]]:
        """Why the region is not clean, from the gate files (empty when it is)."""
        out = [{"what": "drain", "why": f"job {job_id} pid {pid}: drain incomplete: "
                                        f"{drain_reason(status)}"}
               for job_id, pid, status in self.drain_failures]
        for job in self.jobs:
            if job.gate.released:
                continue
            for s in job.gate.slots(job.slot):
                out += _bypasses(job.job_id, s.pid, s.counters)
            if (n := job.gate.overflow_procs(job.slot)):
                out.append({"what": "gate_bypass", "why": f"job {job.job_id}: {n} processes "
                            "found every gate slot taken and run ungated"})
        return out

    def revert(self) -> None:
        """Reopen every gate this op closed, each on its own: one failure must not
        leave the others closed (their processes would park until the next region)."""
        errors = []
        while self._closed:
            job = self._closed.pop()
            try:
                job.gate.open(job.slot)
            except Exception as exc:  # noqa: BLE001 - reported below, after the rest
                errors.append(f"job {job.job_id}: {exc!r}")
        if errors:
            raise RuntimeError("could not reopen gates: " + "; ".join(errors))

    def undo_records(self) -> list[dict]:
        return [{"kind": "gate_open", "path": j.path, "slot": j.slot} for j in self.jobs]


def _bypasses(job_id: int, pid: int, counters: dict[str, int]) -> list[dict[str, str]]:
    """Not-clean entries for one sibling process's interposer counters."""
    out = []
    if counters.get("unwrapped"):
        out.append({"what": "gate_bypass", "why": (
            f"job {job_id} pid {pid}: {counters['unwrapped']} driver entry points handed out "
            f"unwrapped ({counters.get('unmatched', 0)} of an unknown ABI variant): its "
            "launches through them are not gated")})
    if counters.get("ungated"):
        out.append({"what": "gate_bypass", "why": (
            f"job {job_id} pid {pid}: {counters['ungated']} gated calls ran without the gate")})
    return out
