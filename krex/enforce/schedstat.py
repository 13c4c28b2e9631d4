"""Scheduler counters of the holder: involuntary switches and CPU migrations.

Read per thread from ``/proc/PID/task/TID/status``
(``nonvoluntary_ctxt_switches``) and ``/proc/PID/task/TID/sched``
(``se.nr_migrations``, present when the kernel has CONFIG_SCHED_DEBUG).
A :class:`HolderCounters` snapshot taken at region start gives the deltas at
region end; threads born during the region count from zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from krex.enforce.process import ProcessRef, ThreadRef, threads_of


def _field(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split(":")[1].split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _sched(path: str) -> tuple[int, int] | None:
    """(involuntary switches, migrations) from one read of a ``sched`` file."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("nr_involuntary_switches", "se.nr_migrations"):
            values[key] = int(float(value))
    if len(values) < 2:
        return None
    return values["nr_involuntary_switches"], values["se.nr_migrations"]


def _thread_counts(t: ThreadRef) -> tuple[int, int | None]:
    base = f"/proc/{t.pid}/task/{t.tid}"
    both = _sched(base + "/sched")  # one file per thread where the kernel has it
    if both is not None:
        return both
    return _field(base + "/status", "nonvoluntary_ctxt_switches") or 0, None


@dataclass
class HolderCounters:
    refs: list[ProcessRef]
    start: dict[ThreadRef, tuple[int, int | None]] = field(default_factory=dict)

    @classmethod
    def begin(cls, refs: list[ProcessRef]) -> HolderCounters:
        counters = cls(refs)
        counters.start = counters._read()
        return counters

    def _read(self) -> dict[ThreadRef, tuple[int, int | None]]:
        return {t: _thread_counts(t) for ref in self.refs if ref.alive() for t in threads_of(ref)}

    def deltas(self) -> tuple[int, int | None]:
        """(involuntary switches, migrations or None if unreadable) since begin."""
        switches, migrations, have_migrations = 0, 0, False
        for thread, (sw, mig) in self._read().items():
            sw0, mig0 = self.start.get(thread, (0, 0))
            switches += max(0, sw - sw0)
            if mig is not None:
                have_migrations = True
                migrations += max(0, mig - (mig0 or 0))
        return switches, migrations if have_migrations else None
