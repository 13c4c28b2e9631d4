"""Gate and drain: the GPU half of a region, applied before freezing.

For each sibling job on the device: close its gate (new launches park in the
interposer), then wait until every interposed process of the job has
acknowledged that its queued GPU work finished.  Closing all gates first and
then waiting lets the siblings drain in parallel.  A sibling with no active
interposer has launched nothing through it: it is gated (its gate closes, so
a first launch would park) and listed as idle in the report.  When a drain
times out the policy decides: ``abort`` (default: revert and raise
:class:`~krex.errors.DrainTimeout`), ``wait`` (keep waiting up to the
region's maximum hold) or ``kill`` (SIGKILL the processes that did not ack).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

from krex.enforce.gate import GateFile
from krex.enforce.process import ProcessRef
from krex.errors import DrainTimeout

POLICIES = ("abort", "wait", "kill")


@dataclass
class GatedJob:
    job_id: int
    gate: GateFile
    path: str
    slot: int = 0


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
    _closed: list[GatedJob] = field(default_factory=list)

    def available(self) -> tuple[bool, str]:
        return True, ""

    def apply(self) -> None:
        generations = {}
        for job in self.jobs:
            if not job.gate.interposed(job.slot):
                self.idle_jobs.append(job.job_id)
            generations[job.job_id] = job.gate.close(job.slot)
            self._closed.append(job)
        for job in self.jobs:
            self._drain(job, generations[job.job_id])

    def _drain(self, job: GatedJob, generation: int) -> None:
        deadline = time.monotonic() + (self.max_wait_s if self.policy == "wait" else 0)
        while True:
            try:
                self.acks.update(job.gate.wait_drained(job.slot, generation, self.timeout_s))
                return
            except DrainTimeout as exc:
                if self.policy == "kill" and exc.pid:
                    _kill(exc.pid)
                    continue
                if self.policy == "wait" and time.monotonic() < deadline:
                    continue
                exc.message = f"job {job.job_id}: {exc.message}"
                raise

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


def _kill(pid: int) -> None:
    try:
        ProcessRef.of(pid).send_signal(signal.SIGKILL)
    except Exception:  # noqa: BLE001, S110 - gone already: nothing left to drain
        pass
