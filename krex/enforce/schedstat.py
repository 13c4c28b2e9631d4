"""Scheduler counters of the holder over a region.

Per thread, read once at region start and once at region end:
``/proc/PID/task/TID/schedstat`` (CPU time and *run delay*: nanoseconds the
thread was runnable but waiting for a CPU; the kernel's CONFIG_SCHED_INFO),
``/proc/PID/task/TID/status`` (``nonvoluntary_ctxt_switches``) and, where
the kernel has CONFIG_SCHED_DEBUG, ``/proc/PID/task/TID/sched``
(``se.nr_migrations``).  A :class:`HolderCounters` snapshot taken at region
start gives the deltas at region end; threads born during the region count
from zero.  :mod:`krex.enforce.contention` judges the deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from krex.enforce.process import ProcessRef, ThreadRef, read_bytes, threads_of


@dataclass(frozen=True)
class Counts:
    """One thread's counters (or a sum of deltas); None where the kernel has no such file."""

    switches: int = 0  # involuntary context switches
    migrations: int | None = None
    cpu_ns: int | None = None  # time on a CPU
    delay_ns: int | None = None  # runnable but waiting for a CPU


def _field(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split(":")[1].split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None


_SCHED_KEYS = (b"\nnr_involuntary_switches ", b"\nse.nr_migrations ")


def _sched(path: str) -> tuple[int, int] | None:
    """(involuntary switches, migrations) from one read of a ``sched`` file: the two
    lines found by their keys, not every line split (it is read two or three times a
    region, on the daemon's thread: the split was a tenth of its calls)."""
    try:
        data = read_bytes(path)
    except OSError:
        return None
    values = []
    for key in _SCHED_KEYS:
        at = data.find(key)
        colon = data.find(b":", at) if at >= 0 else -1
        if colon < 0:
            return None
        end = data.find(b"\n", colon)
        try:
            values.append(int(float(data[colon + 1:end if end >= 0 else len(data)])))
        except ValueError:
            return None
    return values[0], values[1]


def _schedstat(path: str) -> tuple[int, int] | None:
    """(CPU ns, run-delay ns): fields 1 and 2 of a ``schedstat`` file."""
    try:
        cpu, delay = read_bytes(path).split()[:2]
        return int(cpu), int(delay)
    except (OSError, ValueError):
        return None


def thread_counts(pid: int, tid: int) -> Counts:
    base = f"/proc/{pid}/task/{tid}"
    stat = _schedstat(base + "/schedstat")
    cpu, delay = stat if stat is not None else (None, None)
    both = _sched(base + "/sched")  # one file per thread where the kernel has it
    if both is not None:
        return Counts(both[0], both[1], cpu, delay)
    return Counts(_field(base + "/status", "nonvoluntary_ctxt_switches") or 0, None, cpu, delay)


def _sum(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


@dataclass
class HolderCounters:
    refs: list[ProcessRef]
    start: dict[ThreadRef, Counts] = field(default_factory=dict)

    @classmethod
    def begin(cls, refs: list[ProcessRef]) -> HolderCounters:
        counters = cls(refs)
        counters.start = counters._read()
        return counters

    def _read(self) -> dict[ThreadRef, Counts]:
        return {t: thread_counts(t.pid, t.tid)
                for ref in self.refs if ref.alive() for t in threads_of(ref)}

    def thread_ids(self) -> set[int]:
        return {t.tid for t in self.start}

    def totals(self) -> Counts:
        """The sums of every holder thread's deltas since :meth:`begin` (read now)."""
        per_thread = [_delta(self.start.get(t), now) for t, now in self._read().items()]
        return Counts(sum(d.switches for d in per_thread),
                      _sum([d.migrations for d in per_thread]),
                      _sum([d.cpu_ns for d in per_thread]),
                      _sum([d.delay_ns for d in per_thread]))

    def deltas(self) -> tuple[int, int | None]:
        """(involuntary switches, migrations or None if unreadable) since begin."""
        totals = self.totals()
        return totals.switches, totals.migrations


def _minus(now: int | None, then: int | None) -> int | None:
    return None if now is None else max(0, now - (then or 0))


def _delta(then: Counts | None, now: Counts) -> Counts:
    then = then or Counts(0, 0, 0, 0)
    return Counts(max(0, now.switches - then.switches), _minus(now.migrations, then.migrations),
                  _minus(now.cpu_ns, then.cpu_ns), _minus(now.delay_ns, then.delay_ns))
