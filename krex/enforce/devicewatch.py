"""The device's own account of a region, for fakegpu: what the device itself saw.

fakegpu's device is a thread of krex's fakegpu server (its *execution thread*),
pinned to a core that is not reserved for holders.  Two things slow a region's
kernels there without touching the holder, so the holder's own counters never
show them: the execution thread waiting for its core (another task on the
device's core), and the device running work of other contexts (a process krex
does not gate, a sibling whose work was not drained).

In: the server (:class:`~krex.devices.fakegpu.FakeGpu`) and the holder's
processes.  Out: a :class:`~krex.protocol.report.DeviceAudit` (source
``fakegpu``) and its reasons, ``device_preempted`` and ``foreign_device_work``.
Both readings come from places the holder cannot write: the kernel's
``schedstat`` of the execution thread, and the server's per-context busy
counters (read over its socket by the daemon).  They are sampled when the
region starts and when it ends; a handoff ends one window and starts the next.
A real GPU's foreign contexts and clocks (NVML, :mod:`krex.devices.audit`)
land in the same place of the report.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from krex.enforce.contention import ns_to_ms
from krex.enforce.schedstat import thread_counts
from krex.protocol.report import DeviceAudit, Reason, ReasonCode

# The device's thread may wait for its core this long in a region and still count as
# undisturbed: a floor for an idle device's wake-ups (≈ 10-50 µs each in a VM) plus a
# share of the span.  On a 2-core machine the device's core is also where the daemon's
# own threads run during a region (its warm cgroup pings every 4 ms, krex.enforce.warm):
# measured quiet, they took 3.9-4.8 % of the device thread's time, one preemption per
# ping; a hog on its core takes about half.  docs/enforce.md, "The device's own account".
DEVICE_FLOOR_NS = 200_000
DEVICE_SPAN_FRACTION = 0.10


@dataclass(frozen=True)
class DeviceSample:
    """The device's counters at one moment."""

    mono_ns: int
    holder_busy_ns: int  # run for the holder's contexts, ever
    busy_ns: int  # run for every context, ever
    exec_tid: int
    run_delay_ns: int | None  # the execution thread's, ever (None: unreadable)
    preemptions: int | None  # the execution thread's involuntary switches, ever

    def to_dict(self) -> dict[str, Any]:
        return {"busy_ms": ns_to_ms(self.busy_ns), "exec_tid": self.exec_tid,
                "run_delay_ms": ns_to_ms(self.run_delay_ns), "preemptions": self.preemptions}


def delay_threshold_ns(span_ns: int) -> int:
    """Run delay of the device's thread above which a region of ``span_ns`` counts as
    disturbed."""
    return int(DEVICE_FLOOR_NS + DEVICE_SPAN_FRACTION * span_ns)


class FakegpuWatch:
    """One region's window on the fake device: :meth:`begin`, then :meth:`stop` (or
    :meth:`hand_over`, which stops it and begins the next holder's with one sample)."""

    hands_over = True  # a handoff can split its window (an NVML audit cannot yet)

    def __init__(self, gpu: Any, holder_pids: set[int]) -> None:
        self.gpu = gpu
        self.pids = sorted(holder_pids)
        self.server_pid = gpu.proc.pid if gpu.proc is not None else 0
        self.start: DeviceSample | None = None
        self.end: DeviceSample | None = None

    @classmethod
    def begin(cls, gpu: Any, holder_pids: set[int]) -> FakegpuWatch:
        watch = cls(gpu, holder_pids)
        watch.start = watch._sample()
        return watch

    def _sample(self) -> DeviceSample | None:
        try:
            busy = self.gpu.busy(self.pids)
        except OSError:
            return None  # the server is gone: nothing to say, and the report says so
        counts = thread_counts(self.server_pid, busy.exec_tid) if busy.exec_tid else None
        return DeviceSample(time.monotonic_ns(), busy.of_pids, busy.total, busy.exec_tid,
                            counts.delay_ns if counts else None,
                            counts.switches if counts else None)

    def stop(self) -> None:
        if self.end is None:
            self.end = self._sample()

    def hand_over(self, holder_pids: set[int]) -> FakegpuWatch:
        """Stop this window now and begin the next holder's."""
        self.stop()
        return FakegpuWatch.begin(self.gpu, holder_pids)

    def finish(self) -> tuple[DeviceAudit, list[Reason]]:
        """The audit and the reasons the device's counters give against the region."""
        self.stop()
        start, end = self.start, self.end
        audit = DeviceAudit("fakegpu", start.to_dict() if start else {},
                            end.to_dict() if end else {})
        if start is None or end is None:
            return audit, [Reason.mechanism("device_watch", "the fakegpu server did not "
                                            "answer: the device's own account is missing")]
        return audit, self._judge(start, end, audit)

    def _judge(self, start: DeviceSample, end: DeviceSample, audit: DeviceAudit) -> list[Reason]:
        span = max(1, end.mono_ns - start.mono_ns)
        out = []
        if start.run_delay_ns is not None and end.run_delay_ns is not None \
                and start.exec_tid == end.exec_tid:
            switches = (end.preemptions or 0) - (start.preemptions or 0)
            delay = end.run_delay_ns - start.run_delay_ns
            limit = delay_threshold_ns(span)
            audit.start["run_delay_threshold_ms"] = ns_to_ms(limit)
            if delay > limit:
                out.append(Reason(
                    ReasonCode.DEVICE_PREEMPTED,
                    f"device: its execution thread (tid {end.exec_tid}) waited "
                    f"{ns_to_ms(delay)} ms for its core, preempted {switches} times "
                    f"(threshold {ns_to_ms(limit)} ms in {ns_to_ms(span)} ms): another task "
                    "ran on the device's core",
                    {"run_delay_ms": ns_to_ms(delay), "threshold_ms": ns_to_ms(limit),
                     "span_ms": ns_to_ms(span), "preemptions": switches,
                     "exec_tid": end.exec_tid}))
        foreign = (end.busy_ns - start.busy_ns) - (end.holder_busy_ns - start.holder_busy_ns)
        if foreign > 0:
            pids = self._foreign_pids(start.mono_ns, end.mono_ns)
            audit.foreign_pids = pids
            out.append(Reason(
                ReasonCode.FOREIGN_DEVICE_WORK,
                f"device: ran {ns_to_ms(foreign)} ms of other contexts' work during the "
                f"region (processes {pids or 'unknown'})",
                {"busy_ms": ns_to_ms(foreign), "pids": pids}))
        return out

    def _foreign_pids(self, t0_ns: int, t1_ns: int) -> list[int]:
        """Who ran on the device in the window: the server's launch log (read only when
        other work was found; off the grant path)."""
        try:
            log = self.gpu.launch_log(since_ns=t0_ns)
        except (OSError, ValueError):
            return []
        mine = set(self.pids)
        return sorted({row[1] for row in log if len(row) >= 7 and row[1] not in mine
                       and row[5] and row[5] <= t1_ns and (row[6] >= t0_ns or not row[6])})


class DeviceWatch(Protocol):
    """A source of the device's own account of a region (this module's, or NVML's:
    :class:`krex.enforce.nvmlwatch.NvmlWatch`)."""

    hands_over: bool

    def stop(self) -> None: ...

    def finish(self) -> tuple[DeviceAudit, list[Reason]]: ...


def finish_all(watches: Sequence[DeviceWatch]) -> tuple[DeviceAudit | None, list[Reason]]:
    """A region's device audit (one, whatever its sources: the same place in the report
    for the fake device's truth and a real one's) and the reasons the sources give."""
    audit: DeviceAudit | None = None
    reasons: list[Reason] = []
    for watch in watches:
        found, why = watch.finish()
        audit = found if audit is None else audit.joined(found)
        reasons += why
    return audit, reasons
