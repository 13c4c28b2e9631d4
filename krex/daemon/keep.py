"""A lone job's enforcement, kept between its back-to-back regions (issue 47).

A job that takes region after region with nobody else on the node paid, for each, the
whole set-up (the slot move, the shield's sweep and narrowing, the isolation) and,
after its release, the whole undo -- ~3 ms of its ~6 ms per region here, most of it
for nothing, since the next region needs exactly the same.  When a region ends with
nobody queued, stopped nothing of another job (no sibling frozen or gated) and has no
device watch, its evidence is taken (:meth:`krex.enforce.enforcer.Enforcement.checkpoint`:
the report it would have had) and its enforcement stays applied for :data:`KEEP_MS`
(``KREX_KEEP_MS``; 0: never kept).  The same job's next region within that time, with
the node's jobs unchanged (the same holder, siblings and other jobs, by
:func:`krex.enforce.handoff.job_key`), starts on it: its counters begin at its grant,
its steps are reported ``kept`` (nothing applied), the guardian's lease runs for its
hold.  Anything else -- another job's region, a job that came or went, the time
running out, the daemon stopping -- undoes it on the device's lane first, as its
release would have.  Between the regions the job's processes stay on the reserved
cores and unmanaged tasks off them, for at most :data:`KEEP_MS`; what ran on the
holder's cores during a kept region is judged from its own counters, as in any other.
A process that registers as a job meanwhile joins the device's frozen subtree and
waits for the kept time's end (at most :data:`KEEP_MS`), as it would wait for a region.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

KEEP_ENV = "KREX_KEEP_MS"
KEEP_MS = 50.0


def configured_keep_s() -> float:
    """``KREX_KEEP_MS`` (default :data:`KEEP_MS`; 0: off; at most 10 s) in seconds."""
    try:
        ms = float(os.environ.get(KEEP_ENV, KEEP_MS))
    except ValueError:
        ms = KEEP_MS
    if ms != ms:
        ms = KEEP_MS
    return min(max(ms, 0.0), 10000.0) / 1e3


@dataclass
class Kept:
    """One device's kept enforcement: whose, for which node, until when."""

    job_id: int
    held: Any  # krex.daemon.exclusivity.Held, checkpointed
    key: tuple  # the node's jobs when it was kept (krex.enforce.handoff.job_key)
    until_mono_s: float


class Keeper:
    """The kept enforcements, one per device at most (used under the daemon's lock)."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self.kept: dict[str, Kept] = {}
        self.reused = 0  # regions started on a kept enforcement
        self.undone = 0  # kept enforcements undone unused

    def put(self, device: str, job_id: int, held: Any, key: tuple, now: float) -> None:
        self.kept[device] = Kept(job_id, held, key, now + self.keep_s)

    def take(self, device: str) -> Kept | None:
        return self.kept.pop(device, None)

    def of_job(self, job_id: int) -> list[tuple[str, Kept]]:
        """Remove and return the job's kept enforcements (it ended)."""
        mine = [(d, k) for d, k in self.kept.items() if k.job_id == job_id]
        for device, _ in mine:
            del self.kept[device]
        return mine

    def due(self, now: float) -> list[tuple[str, Kept]]:
        """Remove and return the kept enforcements whose time is over."""
        over = [(d, k) for d, k in self.kept.items() if k.until_mono_s <= now]
        for device, _ in over:
            del self.kept[device]
        return over

    def all(self) -> list[tuple[str, Kept]]:
        out, self.kept = list(self.kept.items()), {}
        return out

    def next_deadline(self) -> float:
        return min((k.until_mono_s for k in self.kept.values()), default=math.inf)

    def describe(self) -> dict[str, Any]:
        return {"keep_ms": self.keep_s * 1e3, "kept": sorted(self.kept), "reused": self.reused,
                "undone": self.undone}
